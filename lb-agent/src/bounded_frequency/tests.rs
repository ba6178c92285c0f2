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

    fn start_with(min: Duration, retry: Duration, max: Duration, before: impl FnOnce(&RunnerHandle)) -> Self {
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
