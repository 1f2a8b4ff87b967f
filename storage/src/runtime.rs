//! The async runtime openraft runs on: Tokio, with one difference.
//!
//! openraft draws its randomised election timeouts from
//! `AsyncRuntime::thread_rng`. Here that is the operating system's
//! generator, as with `openraft::TokioRuntime`, unless the thread was
//! seeded with [`seed_thread_rng`]: then every draw on that thread comes
//! from the seed. The deterministic simulation of the Raft layer
//! (`keel-dst`) seeds the one thread it runs a cluster on, so a seed
//! replays the same elections. Servers never seed it.

use std::cell::RefCell;
use std::future::Future;
use std::time::Duration;

use openraft::async_runtime::TokioOneShotSender;
use openraft::{AsyncRuntime, OptionalSend, TokioInstant};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

thread_local! {
    static SEEDED: RefCell<Option<StdRng>> = const { RefCell::new(None) };
}

/// Makes this thread's Raft randomness come from `seed` from now on
/// (`None`: from the operating system again).
pub fn seed_thread_rng(seed: Option<u64>) {
    SEEDED.with(|s| *s.borrow_mut() = seed.map(StdRng::seed_from_u64));
}

fn draw<T>(f: impl FnOnce(&mut dyn RngCore) -> T) -> T {
    SEEDED.with(|s| match s.borrow_mut().as_mut() {
        Some(seeded) => f(seeded),
        None => f(&mut rand::thread_rng()),
    })
}

/// The generator openraft is handed: this thread's seeded one if it has
/// one, else the operating system's.
#[derive(Debug, Default)]
pub struct RaftRng;

impl RngCore for RaftRng {
    fn next_u32(&mut self) -> u32 {
        draw(|r| r.next_u32())
    }

    fn next_u64(&mut self) -> u64 {
        draw(|r| r.next_u64())
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        draw(|r| r.fill_bytes(dest));
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        draw(|r| r.try_fill_bytes(dest))
    }
}

/// Tokio, as `openraft::TokioRuntime`, with [`RaftRng`] for randomness.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct KeelRuntime;

impl AsyncRuntime for KeelRuntime {
    type JoinError = tokio::task::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = tokio::task::JoinHandle<T>;
    type Sleep = tokio::time::Sleep;
    type Instant = TokioInstant;
    type TimeoutError = tokio::time::error::Elapsed;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = tokio::time::Timeout<T>;
    type ThreadLocalRng = RaftRng;
    type OneshotSender<T: OptionalSend> = TokioOneShotSender<T>;
    type OneshotReceiver<T: OptionalSend> = tokio::sync::oneshot::Receiver<T>;
    type OneshotReceiverError = tokio::sync::oneshot::error::RecvError;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        tokio::task::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        tokio::time::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        tokio::time::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        tokio::time::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        join_error.is_panic()
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        RaftRng
    }

    fn oneshot<T>() -> (Self::OneshotSender<T>, Self::OneshotReceiver<T>)
    where
        T: OptionalSend,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        (TokioOneShotSender(tx), rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    fn timeouts() -> Vec<u64> {
        (0..8)
            .map(|_| KeelRuntime::thread_rng().gen_range(150..300))
            .collect()
    }

    #[test]
    fn a_seeded_thread_draws_the_same_timeouts_again() {
        seed_thread_rng(Some(7));
        let first = timeouts();
        seed_thread_rng(Some(7));
        assert_eq!(timeouts(), first);
        seed_thread_rng(Some(8));
        assert_ne!(timeouts(), first);
        seed_thread_rng(None);
        assert!(timeouts().iter().all(|t| (150..300).contains(t)));
    }
}
