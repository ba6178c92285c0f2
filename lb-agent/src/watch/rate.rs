//! The API client's request rate limit (`--kube-api-qps`, `--kube-api-burst`,
//! `clientConnection.qps`/`.burst`), as client-go's `flowcontrol.NewTokenBucketRateLimiter` that
//! kube-proxy's client uses: a bucket of `burst` tokens refilled at `qps` per second, one token per
//! request (a watch takes one when it starts, however long it then streams). A request without a
//! token waits for one; nothing is refused.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll, ready},
    time::Duration,
};

use tokio::time::{Instant, Sleep};
use tower::{Layer, Service};

/// kube-proxy's defaults (`clientConnection` in its `SetDefaults_KubeProxyConfiguration`).
pub const DEFAULT_QPS: f32 = 5.0;
pub const DEFAULT_BURST: i32 = 10;

/// A token bucket that lends tokens ahead (as `golang.org/x/time/rate`'s `Reserve`): a request
/// always gets its token, after the wait the debt implies, so waiting requests are served in order.
#[derive(Debug)]
pub struct TokenBucket {
    per_second: f64,
    burst: f64,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// Full at `now`.
    pub fn new(qps: f32, burst: i32, now: Instant) -> Self {
        let burst = f64::from(burst.max(1));
        TokenBucket {
            per_second: f64::from(qps),
            burst,
            tokens: burst,
            at: now,
        }
    }

    /// Takes a token at `now`; how long the request must wait for it.
    pub fn reserve(&mut self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.per_second).min(self.burst);
        self.at = self.at.max(now);
        self.tokens -= 1.0;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.per_second)
        }
    }
}

/// The layer the API client's stack gets; `None` (no limit) for a `qps` that is not positive, as
/// client-go does for a negative QPS. A `qps` of 0 means kube-proxy's default.
#[derive(Clone, Debug)]
pub struct RateLimitLayer {
    bucket: Arc<Mutex<TokenBucket>>,
}

impl RateLimitLayer {
    pub fn new(qps: f32, burst: i32) -> Option<Self> {
        if qps < 0.0 || !qps.is_finite() {
            return None;
        }
        let qps = if qps == 0.0 { DEFAULT_QPS } else { qps };
        let burst = if burst == 0 { DEFAULT_BURST } else { burst };
        Some(RateLimitLayer {
            bucket: Arc::new(Mutex::new(TokenBucket::new(qps, burst, Instant::now()))),
        })
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimited<S>;

    fn layer(&self, inner: S) -> RateLimited<S> {
        RateLimited {
            inner,
            bucket: self.bucket.clone(),
            permit: false,
            wait: None,
        }
    }
}

/// A service whose requests take a token first: `poll_ready` is pending until the token's wait
/// has passed (the client's buffer drives it, one request at a time).
pub struct RateLimited<S> {
    inner: S,
    bucket: Arc<Mutex<TokenBucket>>,
    /// A token is held for the next `call`.
    permit: bool,
    wait: Option<Pin<Box<Sleep>>>,
}

impl<S, R> Service<R> for RateLimited<S>
where
    S: Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if !self.permit {
            if self.wait.is_none() {
                let now = Instant::now();
                let wait = self.bucket.lock().unwrap_or_else(|e| e.into_inner()).reserve(now);
                if wait.is_zero() {
                    self.permit = true;
                } else {
                    self.wait = Some(Box::pin(tokio::time::sleep_until(now + wait)));
                }
            }
            if let Some(wait) = self.wait.as_mut() {
                ready!(wait.as_mut().poll(cx));
                self.wait = None;
                self.permit = true;
            }
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> S::Future {
        self.permit = false;
        self.inner.call(request)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use tower::ServiceExt;

    use super::*;

    #[test]
    fn a_full_bucket_serves_its_burst_then_one_request_per_refill() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(5.0, 10, t0);
        for _ in 0..10 {
            assert_eq!(b.reserve(t0), Duration::ZERO);
        }
        // The 11th waits for one token (200 ms at 5 per second), the 12th for two.
        assert_eq!(b.reserve(t0), Duration::from_millis(200));
        assert_eq!(b.reserve(t0), Duration::from_millis(400));
        // A second later the debt (2) is paid and three tokens are back.
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..3 {
            assert_eq!(b.reserve(t1), Duration::ZERO);
        }
        assert!(b.reserve(t1) > Duration::ZERO);
    }

    #[test]
    fn an_idle_bucket_refills_to_its_burst_only() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100.0, 3, t0);
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..3 {
            assert_eq!(b.reserve(later), Duration::ZERO);
        }
        assert_eq!(b.reserve(later), Duration::from_millis(10));
    }

    #[test]
    fn kube_proxys_defaults_and_no_limit() {
        assert!(
            RateLimitLayer::new(-1.0, 10).is_none(),
            "negative QPS: no limit, as client-go"
        );
        let layer = RateLimitLayer::new(0.0, 0).expect("0 = the default");
        let b = layer.bucket.lock().unwrap();
        assert_eq!(
            (b.per_second, b.burst),
            (f64::from(DEFAULT_QPS), f64::from(DEFAULT_BURST))
        );
    }

    /// The layer on a service, with tokio's clock paused: the burst goes at once, then one request
    /// per 1/qps, in order.
    #[tokio::test(start_paused = true)]
    async fn requests_beyond_the_burst_wait_their_turn() {
        let t0 = Instant::now();
        let layer = RateLimitLayer::new(2.0, 3).unwrap();
        let mut svc = layer.layer(tower::service_fn(|i: u32| async move {
            Ok::<_, Infallible>((i, Instant::now()))
        }));
        let mut served = Vec::new();
        for i in 0..6 {
            served.push(svc.ready().await.unwrap().call(i).await.unwrap());
        }
        let offsets: Vec<u128> = served.iter().map(|(_, at)| (*at - t0).as_millis()).collect();
        assert_eq!(offsets, vec![0, 0, 0, 500, 1000, 1500]);
        assert_eq!(
            served.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            (0..6).collect::<Vec<_>>()
        );
    }
}
