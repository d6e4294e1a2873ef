//! [`ResponseFuture`]: the future of one request through the layer.

use axum::body::Body;
use futures_util::future::BoxFuture;
use http::Response;
use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

/// The response future of [`IdempotencyService`](crate::IdempotencyService): the whole protocol
/// of one request (see the example there). Dropping it before it completes (the client went
/// away) rolls back the handler's transaction and releases the key.
pub struct ResponseFuture<E> {
    inner: BoxFuture<'static, Result<Response<Body>, E>>,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(
        protocol: impl Future<Output = Result<Response<Body>, E>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(protocol),
        }
    }
}

impl<E> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<Body>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
