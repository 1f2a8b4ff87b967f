pub mod sshd;
