//! Waiting by polling: tests never sleep for a fixed time.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// Polls `f` every 50 ms until it yields `Some`, for at most `limit`; an error from `f`
/// ends the wait at once.
pub async fn poll<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = f().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
