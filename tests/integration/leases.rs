//! Background job leases last a minute and are renewed while their holder works: a replica
//! killed mid-job is replaced within a minute, and one that works longer than a lease keeps it.

use std::time::Duration;

use sweeper::app::job_lease::{HeldJob, JOB_LEASE, JOB_LEASE_RENEWAL};

use crate::common::*;

async fn lease_left(app: &TestApp, job: &str) -> Option<f64> {
    sqlx::query_scalar(
        "select extract(epoch from lease_until - sweeper.now())::float8
           from sweeper.job_leases where job = $1",
    )
    .bind(job)
    .fetch_optional(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_job_lease_is_renewed_while_held_and_expires_soon_after_its_holder_stops() {
    assert!(JOB_LEASE <= Duration::from_secs(60));
    assert!(JOB_LEASE_RENEWAL <= Duration::from_secs(20));
    let app = TestApp::spawn(Spawn::default()).await;
    let mut other = app.state.clone();
    other.replica_id = uuid::Uuid::new_v4();

    // The default lease: a minute at most.
    let held = HeldJob::take(&app.state, "audit_retention")
        .await
        .unwrap()
        .unwrap();
    let left = lease_left(&app, "audit_retention").await.unwrap();
    assert!(left <= 60.0 && left > 55.0, "{left}");
    assert!(
        HeldJob::take(&other, "audit_retention")
            .await
            .unwrap()
            .is_none()
    );
    drop(held);

    // Held for three times its lease: renewed, never taken by another replica.
    let lease = Duration::from_secs(2);
    let renewal = Duration::from_millis(500);
    let held = HeldJob::take_for(&app.state, "probe", lease, renewal)
        .await
        .unwrap()
        .unwrap();
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(held.held());
        assert!(
            HeldJob::take_for(&other, "probe", lease, renewal)
                .await
                .unwrap()
                .is_none()
        );
    }
    // Its holder stops (dropped: the renewals stop, as they would with the process): the lease
    // expires and another replica takes the job.
    drop(held);
    tokio::time::sleep(lease + Duration::from_millis(500)).await;
    let taken = HeldJob::take_for(&other, "probe", lease, renewal)
        .await
        .unwrap()
        .unwrap();
    assert!(taken.held());
}

#[tokio::test]
async fn a_holder_whose_lease_was_taken_over_learns_it_at_the_next_renewal() {
    let app = TestApp::spawn(Spawn::default()).await;
    let mut other = app.state.clone();
    other.replica_id = uuid::Uuid::new_v4();
    let (lease, renewal) = (Duration::from_secs(30), Duration::from_millis(300));
    let held = HeldJob::take_for(&app.state, "probe", lease, renewal)
        .await
        .unwrap()
        .unwrap();
    // The ledger was out of reach long enough for the lease to lapse, and another replica took
    // the job meanwhile.
    sqlx::query("update sweeper.job_leases set lease_until = sweeper.now() - interval '1 second'")
        .execute(&app.pool)
        .await
        .unwrap();
    let _taken = HeldJob::take_for(&other, "probe", lease, renewal)
        .await
        .unwrap()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !held.held(),
        "the first holder must stop before any step it cannot undo"
    );
}
