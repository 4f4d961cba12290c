//! Flood limits: a token bucket per WebSocket connection (client frames)
//! and per HTTP tenant (requests), answered with `rate_limited` / 429.
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A flood limit: `rate` events per second sustained, `burst` at once.
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: f64, burst: f64) -> TokenBucket {
        TokenBucket { rate, burst, tokens: burst, last: Instant::now() }
    }

    /// Takes one event's token; false when the limit is exceeded.
    pub fn take(&mut self) -> bool {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.last).as_secs_f64() * self.rate).min(self.burst);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// One bucket per HTTP tenant (bearer token), forgotten after a minute idle.
pub struct TenantBuckets {
    buckets: moka::sync::Cache<String, Arc<Mutex<TokenBucket>>>,
    rate: f64,
    burst: f64,
}

impl TenantBuckets {
    pub fn new(rate: f64, burst: f64) -> TenantBuckets {
        let buckets = moka::sync::Cache::builder().max_capacity(100_000).time_to_idle(Duration::from_secs(60)).build();
        TenantBuckets { buckets, rate, burst }
    }

    /// Takes one request's token from `tenant`'s bucket.
    pub fn take(&self, tenant: &str) -> bool {
        let bucket = self.buckets.get_with_by_ref(tenant, || Arc::new(Mutex::new(TokenBucket::new(self.rate, self.burst))));
        let ok = bucket.lock().unwrap_or_else(|e| e.into_inner()).take();
        ok
    }

    /// Seconds until `tenant` may send again (for `Retry-After`).
    pub fn retry_after_secs(&self) -> u64 {
        (1.0 / self.rate).ceil().max(1.0) as u64
    }
}
