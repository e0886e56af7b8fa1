//! A write timeout, which hyper does not have: a connection whose client takes none of its answer
//! for a whole timeout is closed. Without it, a client that stops reading (a zero receive window)
//! keeps its connection, and whatever of its answer the server still holds, for as long as it
//! likes, below the connection cap.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `S`, whose writes fail with [`io::ErrorKind::TimedOut`] once one has waited `timeout` for the
/// client to take a byte. Any write or flush that goes through starts the wait afresh.
pub(super) struct WriteDeadline<S> {
    inner: S,
    timeout: Duration,
    /// Armed by the first write that had to wait, cleared by the next that did not.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WriteDeadline<S> {
    pub(super) fn new(inner: S, timeout: Duration) -> WriteDeadline<S> {
        WriteDeadline {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// What a write that was `polled` answers: as it is if it went through (or failed); if it
    /// must wait, the wait, until the timeout has passed since the first write that waited.
    fn judge<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took none of its answer for the write timeout",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for WriteDeadline<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.judge(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.judge(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_flush(cx);
        this.judge(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_write_the_reader_never_takes_fails_once_the_timeout_passes() {
        // A pipe with room for 8 bytes: the ninth waits until the other end reads.
        let (near, _far) = tokio::io::duplex(8);
        let mut near = WriteDeadline::new(near, Duration::from_millis(50));
        near.write_all(b"12345678").await.unwrap();
        let err = near.write_all(b"9").await.expect_err("nobody reads");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test]
    async fn a_write_the_reader_takes_goes_through_and_the_wait_starts_afresh() {
        let (near, mut far) = tokio::io::duplex(8);
        let mut near = WriteDeadline::new(near, Duration::from_secs(60));
        for round in 0..3u8 {
            near.write_all(&[round; 8]).await.unwrap();
            let reading = tokio::spawn(async move {
                let mut taken = [0u8; 9];
                far.read_exact(&mut taken).await.unwrap();
                (far, taken)
            });
            near.write_all(&[round]).await.expect("taken");
            let (back, taken) = reading.await.unwrap();
            far = back;
            assert_eq!(taken, [round; 9]);
            assert!(
                near.stalled.is_none(),
                "a write that went through disarms the wait"
            );
        }
    }
}
