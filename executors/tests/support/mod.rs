pub mod kube_standin;
pub mod sshd;
