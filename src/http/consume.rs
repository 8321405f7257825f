//! `POST /consume`: the credential decides the body limit and docs/design.md §5's column; the body is
//! read as a stream (hashed, bounded); the execution's outcome is answered by [`super::answer`].

use super::*;

/// Largest `/consume` body accepted from an authenticated push system, in bytes. A push body
/// over [`CONSUME_BODY_LIMIT`] can never succeed, and a push system redelivers what it is not
/// acknowledged: such a body is read as a stream up to this cap (hashed, its first 8 KiB kept),
/// quarantined as an envelope and answered 200 (docs/design.md §5). Past the cap: 413.
pub const PUSH_BODY_HARD_CAP: usize = 10 * 1024 * 1024;

/// A `/consume` body as read: all of it when it is within [`CONSUME_BODY_LIMIT`], else its first
/// [`execute::RAW_BODY_LIMIT`] bytes; its size and SHA-256 always cover every byte.
struct ReadBody {
    bytes: Vec<u8>,
    size: usize,
    sha256: [u8; 32],
}

fn too_large(limit: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body-too-large",
        format!("the body is larger than {limit} bytes; nothing was recorded"),
    )
}

/// Reads `body` up to `cap` bytes, hashing all of it. A declared `Content-Length` over `cap` is
/// refused before any byte is read.
async fn read_body(
    headers: &HeaderMap,
    body: axum::body::Body,
    cap: usize,
) -> Result<ReadBody, Problem> {
    use axum::body::HttpBody;
    use sha2::Digest;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > cap as u64) {
        return Err(too_large(cap));
    }
    let mut body = std::pin::pin!(body);
    let mut hasher = sha2::Sha256::new();
    let mut bytes = Vec::new();
    let mut size = 0usize;
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.map_err(|e| {
            info!(error = %e, "the request body could not be read");
            Problem::new(
                StatusCode::BAD_REQUEST,
                "bad-request",
                "the request body could not be read (the client stopped sending, or its framing is invalid)",
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        size += data.len();
        if size > cap {
            return Err(too_large(cap));
        }
        hasher.update(&data);
        let room = (CONSUME_BODY_LIMIT + 1).saturating_sub(bytes.len());
        bytes.extend_from_slice(&data[..data.len().min(room)]);
    }
    if size > CONSUME_BODY_LIMIT {
        bytes.truncate(execute::RAW_BODY_LIMIT);
    }
    Ok(ReadBody {
        bytes,
        size,
        sha256: hasher.finalize().into(),
    })
}

/// Acknowledges a body that can never succeed from an authenticated sender, after quarantining
/// it (docs/design.md §5: a push system would redeliver it for ever).
async fn quarantine_and_ack(
    state: &AppState,
    body: &ReadBody,
    why: &str,
    caller: &Caller,
) -> Result<Response, Problem> {
    let retry_after = state.config.consume.retry_after.seconds() as u64;
    let id = execute::quarantine_envelope(
        state,
        &body.bytes,
        body.size,
        &hex::encode(body.sha256),
        why,
        &caller.0.subject,
    )
    .await
    .map_err(|f| Problem::unavailable(f.message(), retry_after))?;
    info!(dead_letter_id = id, size = body.size, error = %why, "unusable envelope quarantined");
    Ok((
        StatusCode::OK,
        Json(json!({"result": "quarantined_envelope", "dead_letter_id": id, "error": why})),
    )
        .into_response())
}

/// `POST /consume`: one delivery, timed in `sweeper_consume_duration_seconds`.
pub(super) async fn consume_handler(
    state: State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, Problem> {
    let started = std::time::Instant::now();
    let answer = consume(state, caller, headers, body).await;
    crate::metrics::consume_finished(started.elapsed().as_secs_f64());
    answer
}

/// The delivery itself, authenticated; [`consume_handler`] times it.
// Over 80 lines: the push credential decides how the body is read and answered (docs/design.md §5); the
// branches are that table.
async fn consume(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, Problem> {
    // Whether this is an authenticated push is decided by the credential, before the body is
    // read: it decides the body limit and docs/design.md §5's column.
    let push_credential = caller.0.credential.is_push();
    let cap = if push_credential {
        PUSH_BODY_HARD_CAP
    } else {
        CONSUME_BODY_LIMIT
    };
    caller.require("consume")?;
    let body = read_body(&headers, body, cap).await?;
    caller.verify_digest(&body.sha256)?;
    if body.size > CONSUME_BODY_LIMIT {
        let why = format!(
            "the body is {} bytes, over the {CONSUME_BODY_LIMIT}-byte limit of an envelope",
            body.size
        );
        return quarantine_and_ack(&state, &body, &why, &caller).await;
    }
    let retry_after = state.config.consume.retry_after.seconds() as u64;
    // A Pub/Sub push (wrapped or unwrapped) or a QStash delivery is answered by docs/design.md §5's
    // push column.
    let pubsub = crate::transport::pubsub::parse_push(&headers, &body.bytes);
    if let Some(p) = &pubsub {
        info!(message_id = ?p.message_id, delivery_attempt = ?p.delivery_attempt, "Pub/Sub push");
    }
    if caller.0.credential == crate::auth::Credential::QstashSignature {
        let header = |h: &str| headers.get(h).and_then(|v| v.to_str().ok());
        info!(message_id = ?header("upstash-message-id"), retried = ?header("upstash-retried"),
              "QStash delivery");
    }
    let push = push_credential || pubsub.is_some();
    let envelope = match crate::transport::delivered_envelope(pubsub.as_ref(), &body.bytes) {
        Ok(e) => e,
        // A poison message from an authenticated sender: quarantine it and acknowledge, so
        // the queue does not redeliver it for ever (docs/design.md §5).
        Err(why) => return quarantine_and_ack(&state, &body, &why, &caller).await,
    };
    let outcome = execute::deliver(&state, &envelope.command_id, push, &caller.0.subject)
        .await
        .map_err(|f| Problem::unavailable(f.message(), retry_after))?;
    if let ConsumeOutcome::Unknown { command_id } = &outcome {
        info!(
            command_id,
            push, "delivery of a command the ledger does not know"
        );
        crate::metrics::consume_unknown_command();
    }
    match answer(&envelope.command_id, outcome, push) {
        Answer::Ok(body) => Ok((StatusCode::OK, Json(body)).into_response()),
        // The execution committed the republish: acknowledge.
        Answer::Republish { body, .. } => Ok((StatusCode::OK, Json(body)).into_response()),
        Answer::NotNow {
            reason,
            retry_after_seconds,
        } => Err(
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, "not-now", reason)
                .retry_after(retry_after_seconds),
        ),
        Answer::UnknownCommand { command_id } => Err(Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-command",
            format!("no command `{command_id}` in the ledger"),
        )),
    }
}
