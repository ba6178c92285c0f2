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
mod tests {
    use super::*;

    use tokio::sync::mpsc;

    const MIN: Duration = Duration::from_secs(1);
    const RETRY: Duration = Duration::from_secs(5);
    const MAX: Duration = Duration::from_secs(10);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A runner on a manual clock whose function reports each run's (relative) start time, and fails
    /// when the next entry of `failures` says so.
    struct Harness {
        clock: ManualClock,
        handle: RunnerHandle,
        runs: mpsc::UnboundedReceiver<Duration>,
        fail_next: Arc<Mutex<Vec<bool>>>,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    impl Harness {
        fn start(min: Duration, retry: Duration, max: Duration) -> Self {
            Self::start_with(min, retry, max, |_| {})
        }

        fn start_with(
            min: Duration,
            retry: Duration,
            max: Duration,
            before: impl FnOnce(&RunnerHandle),
        ) -> Self {
            let clock = ManualClock::new();
            let runner =
                BoundedFrequencyRunner::with_clock(min, retry, max, Arc::new(clock.clone())).named("test");
            let handle = runner.handle();
            before(&handle);
            let (tx, runs) = mpsc::unbounded_channel();
            let fail_next: Arc<Mutex<Vec<bool>>> = Arc::default();
            let shutdown = CancellationToken::new();
            let task = {
                let clock = clock.clone();
                let fail_next = fail_next.clone();
                let shutdown = shutdown.clone();
                tokio::spawn(async move {
                    runner
                        .run_loop(
                            move || {
                                let _ = tx.send(clock.elapsed());
                                let fail = {
                                    let mut queue = fail_next.lock().unwrap();
                                    if queue.is_empty() { false } else { queue.remove(0) }
                                };
                                async move { if fail { Err("injected failure") } else { Ok(()) } }
                            },
                            shutdown,
                        )
                        .await
                })
            };
            Self {
                clock,
                handle,
                runs,
                fail_next,
                shutdown,
                task,
            }
        }

        /// Lets every task run until nothing is left to do (no real time passes).
        async fn settle(&self) {
            for _ in 0..200 {
                tokio::task::yield_now().await;
            }
        }

        async fn advance(&self, by: Duration) {
            self.clock.advance(by);
            self.settle().await;
        }

        async fn request(&self) {
            self.handle.run();
            self.settle().await;
        }

        /// The runs started since the last call, as relative start times.
        fn take_runs(&mut self) -> Vec<Duration> {
            let mut out = Vec::new();
            while let Ok(at) = self.runs.try_recv() {
                out.push(at);
            }
            out
        }

        fn fail_next_runs(&self, pattern: &[bool]) {
            self.fail_next.lock().unwrap().extend_from_slice(pattern);
        }

        async fn stop(self) {
            self.shutdown.cancel();
            tokio::time::timeout(Duration::from_secs(5), self.task)
                .await
                .expect("loop stops")
                .unwrap();
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn no_run_without_request_until_max_interval() {
        let mut h = Harness::start(MIN, RETRY, MAX);
        h.settle().await;
        assert!(h.take_runs().is_empty());
        h.advance(MAX - ms(1)).await;
        assert!(h.take_runs().is_empty(), "premature periodic run");
        h.advance(ms(1)).await;
        assert_eq!(h.take_runs(), vec![MAX]);
        // And again, every max interval after the end of the previous run.
        h.advance(MAX).await;
        assert_eq!(h.take_runs(), vec![MAX * 2]);
        h.stop().await;
    }

    /// Upstream's `Test_BoundedFrequencyRunnerNoBurst`, step by step.
    #[tokio::test(flavor = "current_thread")]
    async fn min_interval_coalesces_requests() {
        let mut h = Harness::start(MIN, RETRY, MAX);
        h.settle().await;

        // First request runs immediately.
        h.request().await;
        assert_eq!(h.take_runs(), vec![Duration::ZERO]);
        assert_eq!(h.handle.pending_since(), None);

        // Too soon after the first: deferred.
        h.advance(ms(500)).await;
        h.request().await;
        assert!(h.take_runs().is_empty());
        let pending_at = h.handle.pending_since().expect("request pending");
        h.advance(ms(499)).await;
        h.request().await;
        assert!(h.take_runs().is_empty());
        // The pending time is the oldest request's.
        assert_eq!(h.handle.pending_since(), Some(pending_at));
        assert_eq!(h.handle.pending_for(), Some(ms(499)));

        // Both coalesce into one run exactly min_interval after the first ended.
        h.advance(ms(1)).await;
        assert_eq!(h.take_runs(), vec![ms(1000)]);
        assert_eq!(h.handle.pending_since(), None);

        // Immediately again: deferred by a full min interval.
        h.request().await;
        h.advance(ms(1)).await;
        h.request().await;
        h.advance(ms(998)).await;
        assert!(h.take_runs().is_empty(), "premature");
        h.advance(ms(1)).await;
        assert_eq!(h.take_runs(), vec![ms(2000)]);

        // min interval passes with nothing queued: nothing runs.
        h.advance(MIN).await;
        assert!(h.take_runs().is_empty());

        // max interval after the last run.
        h.advance(MAX - MIN).await;
        assert_eq!(h.take_runs(), vec![ms(12_000)]);

        // A request 1ms after a periodic run waits for the min interval.
        h.advance(ms(1)).await;
        h.request().await;
        assert!(h.take_runs().is_empty());
        h.advance(ms(999)).await;
        assert_eq!(h.take_runs(), vec![ms(13_000)]);
        assert_eq!(h.handle.runs(), 5);
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn request_after_min_interval_runs_immediately() {
        let mut h = Harness::start(MIN, RETRY, MAX);
        h.request().await;
        assert_eq!(h.take_runs(), vec![Duration::ZERO]);
        h.advance(ms(3000)).await;
        h.request().await;
        assert_eq!(h.take_runs(), vec![ms(3000)]);
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn failed_run_is_retried_after_retry_interval() {
        let mut h = Harness::start(MIN, RETRY, MAX);
        h.fail_next_runs(&[true]);
        h.request().await;
        assert_eq!(h.take_runs(), vec![Duration::ZERO]);
        assert!(h.handle.last_run_failed());

        // Nothing after the min interval...
        h.advance(MIN).await;
        assert!(h.take_runs().is_empty());
        // ...the retry comes at retry_interval, well before max_interval.
        h.advance(RETRY - MIN - ms(1)).await;
        assert!(h.take_runs().is_empty(), "premature retry");
        h.advance(ms(1)).await;
        assert_eq!(h.take_runs(), vec![RETRY]);
        assert!(!h.handle.last_run_failed());

        // The successful retry cancels further retries: next run is periodic.
        h.advance(MAX - ms(1)).await;
        assert!(h.take_runs().is_empty());
        h.advance(ms(1)).await;
        assert_eq!(h.take_runs(), vec![RETRY + MAX]);
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn successful_run_cancels_retry() {
        let mut h = Harness::start(MIN, RETRY, MAX);
        h.fail_next_runs(&[true]);
        h.request().await;
        assert_eq!(h.take_runs(), vec![Duration::ZERO]);
        // A request after the min interval succeeds...
        h.advance(MIN).await;
        h.request().await;
        assert_eq!(h.take_runs(), vec![MIN]);
        // ...so nothing happens at the retry time.
        h.advance(RETRY).await;
        assert!(h.take_runs().is_empty(), "retry should have been cancelled");
        // Next is the periodic run, max_interval after the successful one.
        h.advance(MAX - RETRY).await;
        assert_eq!(h.take_runs(), vec![MIN + MAX]);
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn retry_never_beats_min_interval() {
        // retry_interval shorter than min_interval: the min interval still holds.
        let mut h = Harness::start(ms(1000), ms(100), MAX);
        h.fail_next_runs(&[true, true]);
        h.request().await;
        assert_eq!(h.take_runs(), vec![Duration::ZERO]);
        h.advance(ms(999)).await;
        assert!(h.take_runs().is_empty());
        h.advance(ms(1)).await;
        assert_eq!(h.take_runs(), vec![ms(1000)]);
        // Failed again: next retry at the following min interval.
        h.advance(ms(1000)).await;
        assert_eq!(h.take_runs(), vec![ms(2000)]);
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn repeated_failures_keep_retrying() {
        let mut h = Harness::start(MIN, RETRY, MAX);
        h.fail_next_runs(&[true, true, true]);
        h.request().await;
        h.advance(RETRY).await;
        h.advance(RETRY).await;
        h.advance(RETRY).await;
        assert_eq!(h.take_runs(), vec![Duration::ZERO, RETRY, RETRY * 2, RETRY * 3]);
        // The fourth run succeeded: back to the periodic schedule.
        h.advance(RETRY).await;
        assert!(h.take_runs().is_empty());
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn request_before_loop_starts_is_kept() {
        let mut h = Harness::start_with(MIN, RETRY, MAX, |handle| handle.run());
        h.settle().await;
        assert_eq!(h.take_runs(), vec![Duration::ZERO]);
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn requests_during_a_run_stay_pending_for_the_next() {
        let clock = ManualClock::new();
        let runner = BoundedFrequencyRunner::with_clock(MIN, RETRY, MAX, Arc::new(clock.clone()));
        let handle = runner.handle();
        let (started_tx, mut started) = mpsc::unbounded_channel::<()>();
        let release = Arc::new(Notify::new());
        let shutdown = CancellationToken::new();
        let task = {
            let release = release.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                runner
                    .run_loop(
                        move || {
                            let started_tx = started_tx.clone();
                            let release = release.clone();
                            async move {
                                let _ = started_tx.send(());
                                release.notified().await;
                                Ok::<(), std::convert::Infallible>(())
                            }
                        },
                        shutdown,
                    )
                    .await
            })
        };
        handle.run();
        started.recv().await.unwrap();
        assert_eq!(handle.pending_since(), None, "the first request is being served");
        clock.advance(ms(200));
        handle.run();
        let queued = handle.pending_since().expect("queued while running");
        assert_eq!(queued, clock.now());
        // The run takes 300ms more, then the min interval applies from its end.
        clock.advance(ms(300));
        release.notify_one();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(handle.runs(), 1);
        assert_eq!(handle.pending_for(), Some(ms(300)));
        clock.advance(MIN);
        started.recv().await.unwrap();
        assert_eq!(handle.runs(), 2);
        assert_eq!(handle.pending_since(), None);
        release.notify_one();
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test(flavor = "current_thread")]
    async fn shutdown_waits_for_run_in_progress() {
        let clock = ManualClock::new();
        let runner = BoundedFrequencyRunner::with_clock(MIN, RETRY, MAX, Arc::new(clock.clone()));
        let handle = runner.handle();
        let release = Arc::new(Notify::new());
        let finished = Arc::new(Mutex::new(false));
        let shutdown = CancellationToken::new();
        let task = {
            let release = release.clone();
            let finished = finished.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                runner
                    .run_loop(
                        move || {
                            let release = release.clone();
                            let finished = finished.clone();
                            async move {
                                release.notified().await;
                                *finished.lock().unwrap() = true;
                                Ok::<(), String>(())
                            }
                        },
                        shutdown,
                    )
                    .await
            })
        };
        handle.run();
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        shutdown.cancel();
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        assert!(!task.is_finished(), "the run in progress must complete");
        release.notify_one();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert!(*finished.lock().unwrap());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn shutdown_while_idle_and_during_min_interval() {
        let h = Harness::start(MIN, RETRY, MAX);
        h.settle().await;
        h.stop().await;

        let mut h = Harness::start(MIN, RETRY, MAX);
        h.request().await;
        assert_eq!(h.take_runs().len(), 1);
        h.request().await; // waits for the min interval
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn zero_min_interval_runs_every_request() {
        let mut h = Harness::start(Duration::ZERO, RETRY, MAX);
        h.request().await;
        h.request().await;
        h.request().await;
        assert_eq!(h.take_runs(), vec![Duration::ZERO; 3]);
        h.stop().await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn real_clock_smoke() {
        // A few milliseconds of real time: the default clock wires Tokio's timer correctly.
        let runner = BoundedFrequencyRunner::new(ms(1), ms(1), ms(5));
        let handle = runner.handle();
        let shutdown = CancellationToken::new();
        let count = Arc::new(Mutex::new(0u32));
        let task = {
            let count = count.clone();
            let shutdown = shutdown.clone();
            tokio::spawn(runner.run_loop(
                move || {
                    *count.lock().unwrap() += 1;
                    async { Ok::<(), String>(()) }
                },
                shutdown,
            ))
        };
        handle.run();
        // The request, then at least one periodic run (max 5ms).
        tokio::time::timeout(Duration::from_secs(5), async {
            while *count.lock().unwrap() < 2 {
                tokio::time::sleep(ms(1)).await;
            }
        })
        .await
        .expect("runs on real time");
        shutdown.cancel();
        task.await.unwrap();
    }

    #[test]
    #[should_panic(expected = "max_interval")]
    fn max_below_min_panics() {
        let _ = BoundedFrequencyRunner::new(ms(10), ms(10), ms(5));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn manual_clock_sleepers_wake_at_deadline() {
        let clock = ManualClock::new();
        let deadline = clock.now() + ms(10);
        let woke = Arc::new(Mutex::new(false));
        let task = {
            let woke = woke.clone();
            let sleep = clock.sleep_until(deadline);
            tokio::spawn(async move {
                sleep.await;
                *woke.lock().unwrap() = true;
            })
        };
        clock.advance(ms(9));
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(!*woke.lock().unwrap());
        clock.advance(ms(1));
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap();
        assert!(*woke.lock().unwrap());
        // A deadline already in the past completes at once.
        tokio::time::timeout(Duration::from_secs(5), clock.sleep_until(clock.now() - ms(1)))
            .await
            .unwrap();
    }
}
