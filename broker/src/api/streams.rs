//! The agent's stream routes: upload (`POST /api/agent/v1/streams`) and delete. Both run their
//! change detached; an upload reserves its room before it reads a byte.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use http_body_util::BodyExt;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use super::detached::detached;
use super::error::{ApiError, ApiResult, json_response};
use super::extract::{Client, OperationId, content_length};
use crate::core::{Core, new_id};
use crate::store::{StoreError, StreamRecord};
use unyolo_admission::config::Identity;
use unyolo_admission::engine::{Refusal, StorageReservation, Store};

pub(crate) async fn upload_stream(
    State(core): State<Arc<Core>>,
    Client(client): Client,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let declared = content_length(&headers)?.ok_or_else(|| {
        ApiError::new(
            StatusCode::LENGTH_REQUIRED,
            "length_required",
            "A stream upload needs a Content-Length.",
        )
    })?;
    // Nothing to store: unYOLO's brokers refuse an empty stream as input, not as a limit.
    if declared == 0 {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "stream_input_invalid",
            "The stream is empty; an upload needs at least one byte.",
        ));
    }
    // Larger than this client may ever store: no retry could take it, so it is not a 429
    // (which says "later"), and nothing is reserved or read.
    let caps = core.controller().storage_caps().stream;
    let most = caps.client_bytes.min(caps.global_bytes);
    if declared > most {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!(
                "The stream is {declared} bytes; this broker stores at most {most} for a client."
            ),
        ));
    }
    // From here on everything runs detached, reading the body included: a client that hangs up
    // mid-body is a body error there, and the same task removes the file and releases the room.
    detached(store_stream(core, client, declared, body)).await
}

/// Reserves room for a stream, writes its body, then records it; or, if the body or the store
/// fails, removes the file and releases the room. Runs detached.
async fn store_stream(core: Arc<Core>, client: Identity, declared: u64, body: Body) -> ApiResult {
    let id = new_id("st");
    // Reserve before reading a byte: a full store refuses without taking the body. The room is
    // recorded as an upload in progress in the same gated step, so drift counts it as stored.
    let reservation = {
        let _quiet = core.hold_counts().await;
        let refused = |refusal: Refusal| {
            tracing::info!(
                client = %client,
                code = refusal.code.as_str(),
                retry_after = refusal.retry_after_secs(),
                "stream refused"
            );
            ApiError::refused(refusal)
        };
        let reservation = core
            .controller()
            .reserve_storage(client.as_str(), Store::Stream, declared)
            .map_err(refused)?;
        // This process's counts allow it; a store the fleet shares counts every replica's
        // streams and uploads too.
        let caps = core.controller().storage_caps().stream;
        match core
            .db
            .take_stream_room(&id, client.as_str(), declared, &caps)
            .await
        {
            Ok(true) => {}
            Ok(false) => return Err(refused(reservation.refuse())),
            Err(err) => return Err(err.into()),
        }
        core.uploads()
            .insert(id.clone(), (client.to_string(), declared));
        reservation
    };
    let dir = core.db.streams_dir();
    let path = dir.join(&id);
    let written = write_stream(&dir, &path, body, declared).await;

    // The body is complete (or never will be): settle or undo, under the gate. The upload stays
    // recorded until its row is in or its file gone, so the retention sweep (which looks for a
    // file's row only once the file has no upload) never takes a stored stream's file.
    let _quiet = core.hold_counts().await;
    let answer = settle(&core, &client, &id, &path, written, reservation).await;
    if answer.is_err() {
        give_back_room(&core, &id).await;
    }
    core.uploads().remove(&id);
    answer
}

/// Lets go of the room upload `id` took in the store. If the store cannot be reached now, it
/// is tried again in the background for a while (until then the room counts against the
/// caps, refusing more, never admitting more); this replica's next start lets go of it too.
async fn give_back_room(core: &Arc<Core>, id: &str) {
    let Err(err) = core.db.give_back_stream_room(id).await else {
        return;
    };
    tracing::warn!(upload = %id, error = %err, "an upload's room could not be given back; retrying");
    let (db, id) = (Arc::clone(&core.db), id.to_owned());
    tokio::spawn(async move {
        for _ in 0..60 {
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            if db.give_back_stream_room(&id).await.is_ok() {
                return;
            }
        }
        tracing::warn!(upload = %id, "an upload's room is held until this replica restarts");
    });
}

/// Settles upload `id` whose body was `written` to `path`: the row in, the room kept, 201; or
/// the file removed and the room released.
async fn settle(
    core: &Core,
    client: &Identity,
    id: &str,
    path: &std::path::Path,
    written: Result<u64, ApiError>,
    reservation: StorageReservation,
) -> ApiResult {
    // Undoing: the file goes; dropping the reservation or the stored object releases its room.
    async fn undo(path: &std::path::Path, err: ApiError) -> ApiResult {
        let _ = tokio::fs::remove_file(path).await;
        Err(err)
    }
    let size = match written {
        Ok(size) => size,
        Err(err) => {
            drop(reservation);
            return undo(path, err).await;
        }
    };
    let stored = match reservation.settle(size) {
        Ok(stored) => stored,
        Err(refusal) => return undo(path, ApiError::refused(refusal)).await,
    };
    let row = StreamRecord {
        id: id.to_owned(),
        client_id: client.to_string(),
        size,
    };
    if let Err(err) = core.db.insert_stream(row).await {
        drop(stored);
        return undo(path, err.into()).await;
    }
    core.stored_streams().insert(id.to_owned(), stored);
    tracing::info!(stream = %id, client = %client, size, "stream stored");
    let mut response = json_response(StatusCode::CREATED, json!({"id": id, "size": size}));
    if let Ok(location) = HeaderValue::from_str(&format!("/api/agent/v1/streams/{id}")) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

/// Writes at most `declared` bytes of `body` to `path` (synced); a body of another length is
/// refused.
async fn write_stream(
    dir: &std::path::Path,
    path: &std::path::Path,
    mut body: Body,
    declared: u64,
) -> Result<u64, ApiError> {
    let io_error = |err: std::io::Error| ApiError::from(StoreError::io("write", path, err));
    tokio::fs::create_dir_all(dir).await.map_err(io_error)?;
    let mut file = tokio::fs::File::create(path).await.map_err(io_error)?;
    let mut size: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|err| ApiError::unreadable_body(&err))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        size += data.len() as u64;
        if size > declared {
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload_too_large",
                "The body is longer than its Content-Length.",
            ));
        }
        file.write_all(&data).await.map_err(io_error)?;
    }
    if size != declared {
        return Err(ApiError::invalid(
            "The body is shorter than its Content-Length.",
        ));
    }
    file.sync_all().await.map_err(io_error)?;
    Ok(size)
}

pub(crate) async fn delete_stream(
    State(core): State<Arc<Core>>,
    Client(client): Client,
    OperationId(id): OperationId,
) -> ApiResult {
    let not_found = || ApiError::new(StatusCode::NOT_FOUND, "stream_not_found", "No such stream.");
    match core.db.get_stream(&id).await? {
        Some(stream) if stream.client_id == client.as_str() => {}
        _ => return Err(not_found()),
    }
    // Decided: row, file and room go together, whether or not the client waits.
    detached(async move {
        let _quiet = core.hold_counts().await;
        if !core.db.delete_stream(&id).await? {
            return Err(not_found());
        }
        let _ = tokio::fs::remove_file(core.db.streams_dir().join(&id)).await;
        if let Some(object) = core.stored_streams().remove(&id) {
            object.release();
        }
        tracing::info!(stream = %id, client = %client, "stream deleted");
        Ok(json_response(
            StatusCode::OK,
            json!({"id": id, "deleted": true}),
        ))
    })
    .await
}
