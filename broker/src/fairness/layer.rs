//! The tower layer: classify each request, hold its units from before the handler runs until its
//! response body has ended or been dropped, and answer a refused request at once.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderValue, Request, Response, StatusCode, header, request::Parts};
use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::share::{Class, Fairness, FairnessRefusal, UnitsPermit};

/// The code of the default refusal's error envelope.
pub const REFUSAL_CODE: &str = "client_request_limit";

/// Builds the response a refused request gets.
type RefusalResponse = dyn Fn(&FairnessRefusal) -> Response<Bytes> + Send + Sync;

/// A [`tower::Layer`] that puts [`Fairness`] in front of a service: `classify` says what each
/// request is (exempt, whose, what it costs) from its head; a refused request gets the
/// [`FairnessLayer::refusal_response`] (by default [`default_refusal_response`]) without reaching
/// the service. A request let through carries its [`Class`] in its extensions, so the service
/// learns whose it is without authenticating it a second time.
pub struct FairnessLayer<C> {
    fairness: Fairness,
    classify: Arc<C>,
    refusal: Arc<RefusalResponse>,
}

impl<C> Clone for FairnessLayer<C> {
    fn clone(&self) -> Self {
        FairnessLayer {
            fairness: self.fairness.clone(),
            classify: Arc::clone(&self.classify),
            refusal: Arc::clone(&self.refusal),
        }
    }
}

impl<C> FairnessLayer<C>
where
    C: Fn(&Parts) -> Class + Send + Sync + 'static,
{
    /// A layer sharing `fairness` (clone it first to keep a handle for snapshots and metrics)
    /// that classifies requests with `classify`.
    pub fn new(fairness: Fairness, classify: C) -> FairnessLayer<C> {
        FairnessLayer {
            fairness,
            classify: Arc::new(classify),
            refusal: Arc::new(default_refusal_response),
        }
    }

    /// Answers refused requests with `respond` instead of [`default_refusal_response`], so the
    /// refusal speaks the server's own error envelope.
    pub fn refusal_response(
        self,
        respond: impl Fn(&FairnessRefusal) -> Response<Bytes> + Send + Sync + 'static,
    ) -> FairnessLayer<C> {
        FairnessLayer {
            refusal: Arc::new(respond),
            ..self
        }
    }
}

impl<S, C> tower::Layer<S> for FairnessLayer<C> {
    type Service = FairnessService<S, C>;

    fn layer(&self, inner: S) -> FairnessService<S, C> {
        FairnessService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service [`FairnessLayer`] wraps around another.
pub struct FairnessService<S, C> {
    inner: S,
    layer: FairnessLayer<C>,
}

impl<S: Clone, C> Clone for FairnessService<S, C> {
    fn clone(&self) -> Self {
        FairnessService {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S, C, ReqBody, ResBody> tower::Service<Request<ReqBody>> for FairnessService<S, C>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    C: Fn(&Parts) -> Class + Send + Sync + 'static,
    ReqBody: Send + 'static,
{
    type Response = Response<FairBody<ResBody>>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = Result<Response<FairBody<ResBody>>, S::Error>> + Send>>;

    /// Always ready: a request may first wait for its units, so the inner service's readiness is
    /// awaited once they are held, on the clone that serves it.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let (mut parts, body) = request.into_parts();
        let class = (self.layer.classify)(&parts);
        // The service reads who the request was classified as, instead of asking again.
        parts.extensions.insert(class.clone());
        let request = Request::from_parts(parts, body);
        // The clone goes back into `self`; the instance taken is the one this call drives.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let fairness = self.layer.fairness.clone();
        let refusal = Arc::clone(&self.layer.refusal);
        Box::pin(async move {
            match fairness.acquire(class).await {
                Ok(permit) => {
                    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
                    let response = inner.call(request).await?;
                    Ok(response.map(|body| FairBody::served(body, permit)))
                }
                Err(refused) => Ok(refusal(&refused).map(FairBody::refused)),
            }
        })
    }
}

/// The response body of a request that went through [`FairnessLayer`]: the service's body,
/// holding the request's units until it ends, fails or is dropped (so a long-poll or a streamed
/// body counts for as long as it lives), or a refusal's bytes.
pub struct FairBody<B> {
    kind: Kind<B>,
}

enum Kind<B> {
    Served {
        body: Pin<Box<B>>,
        permit: Option<UnitsPermit>,
    },
    Refused(Option<Bytes>),
}

impl<B> FairBody<B> {
    fn served(body: B, permit: UnitsPermit) -> FairBody<B> {
        FairBody {
            kind: Kind::Served {
                body: Box::pin(body),
                permit: Some(permit),
            },
        }
    }

    fn refused(bytes: Bytes) -> FairBody<B> {
        FairBody {
            kind: Kind::Refused(Some(bytes).filter(|b| !b.is_empty())),
        }
    }
}

impl<B> Body for FairBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match &mut self.get_mut().kind {
            Kind::Served { body, permit } => {
                let polled = body.as_mut().poll_frame(cx);
                let ended = match &polled {
                    Poll::Ready(None | Some(Err(_))) => true,
                    Poll::Ready(Some(Ok(_))) => body.is_end_stream(),
                    Poll::Pending => false,
                };
                if ended {
                    // The body is done: the units go back now, not when hyper drops it.
                    permit.take();
                }
                polled
            }
            Kind::Refused(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Served { body, .. } => body.is_end_stream(),
            Kind::Refused(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Served { body, .. } => body.size_hint(),
            Kind::Refused(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len()) as u64)
            }
        }
    }
}

/// The refusal every [`FairnessLayer`] answers unless told otherwise: `429 Too Many Requests`,
/// `Retry-After`, `Cache-Control: no-store` and the error envelope
/// `{"error":{"code":"client_request_limit","message":"..."}}`.
pub fn default_refusal_response(refusal: &FairnessRefusal) -> Response<Bytes> {
    let secs = refusal.retry_after_secs();
    let message = format!("Too many requests of this client are in flight; retry after {secs} s.");
    let body = serde_json::json!({"error": {"code": REFUSAL_CODE, "message": message}});
    let mut response = Response::new(Bytes::from(body.to_string()));
    *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
