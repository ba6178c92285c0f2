//! When the agent syncs: a port of kube-proxy's `BoundedFrequencyRunner`
//! (`pkg/proxy/runner/bounded_frequency_runner.go`; in older releases
//! `pkg/util/async/bounded_frequency_runner.go`).
//!
//! The agent calls [`RunnerHandle::run`] whenever a watched object changes, and [`BoundedFrequencyRunner::run_loop`]
//! calls the sync function, with upstream's three guarantees:
//!
//! 1. **minimum interval**: at least `min_interval` passes between the *end* of one run and the *start* of
//!    the next; requests made meanwhile are coalesced into one run when the interval expires;
//! 2. **maximum interval**: the function runs at least once every `max_interval` (measured from the end of
//!    the previous run), with or without requests;
//! 3. **retry interval**: a run that returns `Err` is retried no later than `retry_interval` after it
//!    ended (but never before the minimum interval); any successful run cancels the pending retry.
//!
//! This follows the current upstream loop (one goroutine selecting on the max timer, the retry timer and
//! the run channel, then waiting on the min timer after each run), not the older token-bucket variant
//! with `burstRuns`: kube-proxy always used a burst of 2 in iptables mode and 1 elsewhere, and the newer
//! runner dropped bursts altogether.
//!
//! Differences from upstream, all deliberate:
//!
//! * a [`RunnerHandle::run`] made before the loop starts is remembered, where upstream drops it (its
//!   `Run()` returns early until `Loop` is ready). The first run still happens only on request or after
//!   `max_interval`, as upstream;
//! * the runner remembers when the oldest request not yet served was made
//!   ([`RunnerHandle::pending_since`]), which is what kube-proxy's `/healthz` needs ("an update has been
//!   queued for longer than the health timeout"). A request counts as served by a run that *starts* after
//!   it; requests arriving while a run is in progress stay pending for the next run;
//! * shutdown never interrupts a run in progress (upstream's `fn` is synchronous, so the same holds there);
//!   it is observed while waiting;
//! * a panic in the sync function is not caught (upstream's `HandleCrash` re-panics by default too).
//!
//! Time comes from a [`Clock`], so the tests drive the loop with a [`ManualClock`] and no real sleeps.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

/// A boxed, sendable future, as returned by [`Clock::sleep_until`].
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// The runner's source of time.
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
    /// A future that completes once `now() >= deadline`.
    fn sleep_until(&self, deadline: Instant) -> Sleep;
}

/// Real time, through the Tokio timer.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokioClock;

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn sleep_until(&self, deadline: Instant) -> Sleep {
        Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)))
    }
}

/// A clock that only moves when told to ([`ManualClock::advance`]); sleepers wake as soon as their
/// deadline is reached. For tests (the agent's too).
#[derive(Clone, Debug)]
pub struct ManualClock {
    base: Instant,
    offset: Arc<watch::Sender<Duration>>,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl ManualClock {
    pub fn new() -> Self {
        Self {
            base: Instant::now(),
            offset: Arc::new(watch::Sender::new(Duration::ZERO)),
        }
    }

    /// Moves time forward by `by`, waking every sleeper whose deadline is reached.
    pub fn advance(&self, by: Duration) {
        self.offset.send_modify(|offset| *offset += by);
    }

    /// Time elapsed since the clock was created (its "relative now").
    pub fn elapsed(&self) -> Duration {
        *self.offset.borrow()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + *self.offset.borrow()
    }

    fn sleep_until(&self, deadline: Instant) -> Sleep {
        let base = self.base;
        let mut offset = self.offset.subscribe();
        Box::pin(async move {
            // `wait_for` checks the current value first, then every change.
            let _ = offset.wait_for(|now| base + *now >= deadline).await;
        })
    }
}

/// Why the loop ran the function (logged at debug level).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunReason {
    /// [`RunnerHandle::run`] was called.
    Requested,
    /// `max_interval` passed since the previous run.
    Periodic,
    /// The previous run failed and `retry_interval` passed.
    Retry,
}

impl fmt::Display for RunReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RunReason::Requested => "requested",
            RunReason::Periodic => "periodic",
            RunReason::Retry => "retry",
        })
    }
}

#[derive(Debug, Default)]
struct State {
    /// When the oldest request not yet served was made.
    pending_since: Option<Instant>,
    /// Runs started so far.
    runs: u64,
    /// Whether the last completed run failed.
    last_failed: bool,
}

struct Shared {
    notify: Notify,
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        // The lock is never held across a panic-prone call; recover anyway rather than cascade.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("state", &*self.state())
            .finish_non_exhaustive()
    }
}

/// Runs a function with bounded frequency; see the module documentation.
#[derive(Debug)]
pub struct BoundedFrequencyRunner {
    name: String,
    min_interval: Duration,
    retry_interval: Duration,
    max_interval: Duration,
    shared: Arc<Shared>,
}

/// A cheap, cloneable handle to request runs and observe the runner.
#[derive(Clone, Debug)]
pub struct RunnerHandle {
    shared: Arc<Shared>,
}

impl RunnerHandle {
    /// Requests a run as soon as the minimum interval allows. Never blocks; requests made before the
    /// next run starts are coalesced into that one run.
    pub fn run(&self) {
        {
            let mut state = self.shared.state();
            if state.pending_since.is_none() {
                state.pending_since = Some(self.shared.clock.now());
            }
        }
        self.shared.notify.notify_one();
    }

    /// When the oldest request that no run has started to serve yet was made; `None` when every request
    /// has been picked up.
    pub fn pending_since(&self) -> Option<Instant> {
        self.shared.state().pending_since
    }

    /// How long the oldest unserved request has been waiting.
    pub fn pending_for(&self) -> Option<Duration> {
        let since = self.pending_since()?;
        Some(self.shared.clock.now().saturating_duration_since(since))
    }

    /// Runs started so far.
    pub fn runs(&self) -> u64 {
        self.shared.state().runs
    }

    /// Whether the last completed run returned an error (a retry is then scheduled).
    pub fn last_run_failed(&self) -> bool {
        self.shared.state().last_failed
    }
}

impl BoundedFrequencyRunner {
    /// A runner on real time.
    ///
    /// # Panics
    ///
    /// When `max_interval < min_interval`, as upstream's constructor.
    pub fn new(min_interval: Duration, retry_interval: Duration, max_interval: Duration) -> Self {
        Self::with_clock(min_interval, retry_interval, max_interval, Arc::new(TokioClock))
    }

    /// A runner on the given clock.
    ///
    /// # Panics
    ///
    /// When `max_interval < min_interval`, as upstream's constructor.
    pub fn with_clock(
        min_interval: Duration,
        retry_interval: Duration,
        max_interval: Duration,
        clock: Arc<dyn Clock>,
    ) -> Self {
        assert!(
            max_interval >= min_interval,
            "BoundedFrequencyRunner: max_interval ({max_interval:?}) must be >= min_interval ({min_interval:?})"
        );
        Self {
            name: "sync".to_string(),
            min_interval,
            retry_interval,
            max_interval,
            shared: Arc::new(Shared {
                notify: Notify::new(),
                state: Mutex::default(),
                clock,
            }),
        }
    }

    /// Names the runner in its log lines (default `sync`).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    pub fn handle(&self) -> RunnerHandle {
        RunnerHandle {
            shared: self.shared.clone(),
        }
    }

    pub fn min_interval(&self) -> Duration {
        self.min_interval
    }

    pub fn retry_interval(&self) -> Duration {
        self.retry_interval
    }

    pub fn max_interval(&self) -> Duration {
        self.max_interval
    }

    /// Calls `f` under the three guarantees until `shutdown` is cancelled. `Err` schedules a retry and
    /// is logged; a run in progress is always completed before the loop returns.
    pub async fn run_loop<F, Fut, E>(self, mut f: F, shutdown: CancellationToken)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: fmt::Display,
    {
        let clock = self.shared.clock.clone();
        tracing::debug!(runner = %self.name, "loop running");
        let mut max_deadline = clock.now() + self.max_interval;
        let mut retry_deadline: Option<Instant> = None;
        loop {
            let Some(reason) = self.wait(&shutdown, max_deadline, retry_deadline).await else {
                break;
            };
            {
                // Everything queued until now is served by this run.
                let mut state = self.shared.state();
                state.pending_since = None;
                state.runs += 1;
            }
            tracing::debug!(runner = %self.name, %reason, "running");
            let result = f().await;
            let ended = clock.now();
            let failed = result.is_err();
            if let Err(e) = result {
                tracing::warn!(runner = %self.name, retry_in = ?self.retry_interval, "run failed: {e}");
                retry_deadline = Some(ended + self.retry_interval);
            } else {
                retry_deadline = None;
            }
            self.shared.state().last_failed = failed;
            max_deadline = ended + self.max_interval;
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = clock.sleep_until(ended + self.min_interval) => {}
            }
        }
        tracing::debug!(runner = %self.name, "loop stopping");
    }

    /// Waits for a reason to run; `None` on shutdown.
    async fn wait(
        &self,
        shutdown: &CancellationToken,
        max_deadline: Instant,
        retry_deadline: Option<Instant>,
    ) -> Option<RunReason> {
        let clock = &self.shared.clock;
        let mut max_sleep = clock.sleep_until(max_deadline);
        let mut retry_sleep: Sleep = match retry_deadline {
            Some(deadline) => clock.sleep_until(deadline),
            None => Box::pin(std::future::pending()),
        };
        loop {
            if self.shared.state().pending_since.is_some() {
                return Some(RunReason::Requested);
            }
            // A request between the check above and this wait leaves a permit: no lost wake-up.
            let notified = self.shared.notify.notified();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return None,
                _ = notified => continue,
                _ = &mut retry_sleep => return Some(RunReason::Retry),
                _ = &mut max_sleep => return Some(RunReason::Periodic),
            }
        }
    }
}

#[cfg(test)]
mod tests;
