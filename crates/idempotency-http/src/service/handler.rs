//! [`Handler`]: the one bound the protocol's steps put on the inner service.

use crate::error::BoxError;
use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response};
use std::future::Future;
use tower::Service;

/// The inner service as the layer's steps call it: a tower service of `Request<Body>` that
/// can be sent to another task, whose answer (any `Bytes` body) comes back as a
/// `Response<Body>`. Every service the public [`Service`] impl accepts is one.
pub(crate) trait Handler:
    Service<Request<Body>, Future: Send + 'static, Error: Send + 'static> + Send + 'static
{
    /// Calls the service (which must be ready) and boxes its answer's body.
    fn handle(
        &mut self,
        request: Request<Body>,
    ) -> impl Future<Output = Result<Response<Body>, Self::Error>> + Send + 'static;
}

impl<T, B> Handler for T
where
    T: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    T::Future: Send + 'static,
    T::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn handle(
        &mut self,
        request: Request<Body>,
    ) -> impl Future<Output = Result<Response<Body>, Self::Error>> + Send + 'static {
        let answer = self.call(request);
        async move { answer.await.map(|response| response.map(Body::new)) }
    }
}
