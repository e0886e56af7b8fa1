//! The one place that knows which backends this build has. With the cargo feature `redis` the
//! shared half of a replicated [`Admission`](super::Admission) is the Redis controller
//! ([`crate::redis`]); without it, the same names stand for types that cannot exist, so the
//! admission's code is written once and a request for replicas fails at set-up
//! ([`SetupError::NoRedisBackend`]). Nothing else in the crate, the broker included, switches on
//! the feature.

use std::future::Future;
use std::time::Duration;

use super::options::ReplicaOptions;
use super::outcome::SetupError;
use crate::config::Config;

/// How long a start refused by the shared pool waits before trying again: other replicas give
/// shared slots back without telling this one.
pub(crate) const SHARED_RETRY: Duration = Duration::from_secs(1);

#[cfg(feature = "redis")]
pub(crate) use crate::redis::{
    RedisController as SharedController, RedisOperation as SharedOperation,
    RedisPermit as SharedPermit,
};

#[cfg(not(feature = "redis"))]
pub(crate) use absent::{SharedController, SharedOperation, SharedPermit};

/// The shared controller of one replica, connected lazily (so a replica starts while Redis is
/// down).
pub(crate) fn connect(
    config: Config,
    options: ReplicaOptions,
) -> Result<SharedController, SetupError> {
    options.check()?;
    #[cfg(feature = "redis")]
    return SharedController::connect_lazy(config, options);
    #[cfg(not(feature = "redis"))]
    {
        let _ = config;
        Err(SetupError::NoRedisBackend)
    }
}

/// `local` (this process's bell: a slot given back here), or the shared retry pause, whichever
/// comes first.
pub(crate) async fn local_or_pause(local: impl Future<Output = ()>) {
    #[cfg(feature = "redis")]
    tokio::select! {
        _ = local => {}
        _ = tokio::time::sleep(SHARED_RETRY) => {}
    }
    #[cfg(not(feature = "redis"))]
    local.await
}

/// Stand-ins for a build without Redis: uninhabited, so every call on them is unreachable and
/// costs nothing.
#[cfg(not(feature = "redis"))]
mod absent {
    use super::super::outcome::{
        AdmitError, BackendStats, DeploymentCounts, NotStarted, RestoredOperation, Unavailable,
    };
    use crate::config::Config;
    use crate::engine::{CancelOutcome, QuotaStatus, TransitionError};

    #[derive(Clone)]
    pub(crate) enum SharedController {}
    pub(crate) enum SharedPermit {}
    pub(crate) enum SharedOperation {}

    impl SharedController {
        pub(crate) fn replica(&self) -> &str {
            match *self {}
        }
        pub(crate) async fn admit(
            &self,
            _: &str,
            _: bool,
            _: &str,
            _: Option<&str>,
        ) -> Result<SharedPermit, AdmitError> {
            match *self {}
        }
        pub(crate) fn reload(&self, _: Config) {
            match *self {}
        }
        pub(crate) async fn register_or_defer(
            &self,
            _: impl IntoIterator<Item = RestoredOperation>,
        ) -> (Vec<SharedOperation>, Option<Unavailable>) {
            match *self {}
        }
        pub(crate) async fn adopt(
            &self,
            _: impl IntoIterator<Item = RestoredOperation>,
        ) -> (Vec<SharedOperation>, Option<Unavailable>) {
            match *self {}
        }
        pub(crate) async fn recount(&self) -> Result<(), Unavailable> {
            match *self {}
        }
        pub(crate) async fn counts(&self) -> Result<DeploymentCounts, Unavailable> {
            match *self {}
        }
        pub(crate) async fn quota_now(&self, _: &str) -> Result<Option<QuotaStatus>, Unavailable> {
            match *self {}
        }
        pub(crate) async fn flush(&self) -> bool {
            match *self {}
        }
        pub(crate) async fn reap(&self) -> Result<u64, Unavailable> {
            match *self {}
        }
        pub(crate) async fn renew(&self) -> Result<(), Unavailable> {
            match *self {}
        }
        pub(crate) async fn shutdown(&self) {
            match *self {}
        }
        pub(crate) fn stats(&self) -> BackendStats {
            match *self {}
        }
        pub(crate) fn set_source(
            &self,
            _: std::sync::Arc<dyn super::super::recovery::RecoverySource>,
        ) {
            match *self {}
        }
        pub(crate) async fn retire_keys(
            &self,
            _: &[super::super::recovery::KeyRecord],
        ) -> Result<(), Unavailable> {
            match *self {}
        }
        pub(crate) async fn retire_keys_then<T>(
            &self,
            _: &[super::super::recovery::KeyRecord],
            _: impl std::future::Future<Output = T>,
        ) -> Result<T, Unavailable> {
            match *self {}
        }
        pub(crate) async fn renew_keys(
            &self,
            _: &[super::super::recovery::KeyRecord],
        ) -> Result<u64, Unavailable> {
            match *self {}
        }
        pub(crate) async fn holdings(
            &self,
        ) -> Result<std::collections::BTreeMap<String, crate::engine::OperationState>, Unavailable>
        {
            match *self {}
        }
    }

    impl SharedPermit {
        pub(crate) fn quota(&self) -> Option<QuotaStatus> {
            match *self {}
        }
        pub(crate) fn commit(self) -> SharedOperation {
            match self {}
        }
        pub(crate) async fn refund(self) {
            match self {}
        }
    }

    impl SharedOperation {
        pub(crate) fn id(&self) -> &str {
            match *self {}
        }
        pub(crate) async fn approve(&self) -> Result<(), TransitionError> {
            match *self {}
        }
        pub(crate) async fn deny(&self) -> Result<(), TransitionError> {
            match *self {}
        }
        pub(crate) async fn cancel(&self) -> Result<CancelOutcome, TransitionError> {
            match *self {}
        }
        pub(crate) async fn expire(&self) -> Result<(), TransitionError> {
            match *self {}
        }
        pub(crate) async fn fail(&self) -> Result<(), TransitionError> {
            match *self {}
        }
        pub(crate) async fn succeed(&self) -> Result<(), TransitionError> {
            match *self {}
        }
        pub(crate) async fn try_start(&self) -> Result<(), NotStarted> {
            match *self {}
        }
        pub(crate) fn hand_over(&self) -> bool {
            match *self {}
        }
    }
}
