//! Who serves this store: each replica holds a row of `replicas` with a lease on the server's
//! clock (`clock_timestamp()`, so replicas' clocks never matter), taken when it starts, renewed
//! while it runs and given up when it stops. Joining runs under an advisory lock
//! (`schema::FLEET_LOCK`), so of two replicas starting at once the second sees the first.

use std::time::{Duration, SystemTime};

use super::super::durable::FleetRows;
use super::super::error::StoreError;
use super::handle::PostgresStore;
use super::rows::{column, state_column};
use super::schema::FLEET_LOCK;

/// A lease as PostgreSQL's `interval` input: whole milliseconds.
fn interval(lease: Duration) -> String {
    format!("{} milliseconds", lease.as_millis().max(1))
}

impl PostgresStore {
    /// Takes (or renews) `replica`'s membership for `lease`, and answers the other replicas whose
    /// lease is live now; lapsed memberships are removed on the way.
    pub async fn join_fleet(
        &self,
        replica: &str,
        lease: Duration,
    ) -> Result<Vec<String>, StoreError> {
        // The first join names the owner of this process's new operations for good.
        let _ = self.member.set(replica.to_owned());
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(|e| self.sorted(e))?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&FLEET_LOCK])
            .await
            .map_err(|e| self.sorted(e))?;
        tx.execute(
            "DELETE FROM replicas WHERE lease_until < clock_timestamp()",
            &[],
        )
        .await
        .map_err(|e| self.sorted(e))?;
        let others = tx
            .query(
                "SELECT name FROM replicas WHERE name <> $1 ORDER BY name",
                &[&replica],
            )
            .await
            .map_err(|e| self.sorted(e))?
            .iter()
            .map(|row| row.get::<_, String>(0))
            .collect();
        tx.execute(
            "INSERT INTO replicas (name, lease_until, joined_at) \
             VALUES ($1, clock_timestamp() + $2::text::interval, clock_timestamp()) \
             ON CONFLICT (name) DO UPDATE SET lease_until = EXCLUDED.lease_until, \
             joined_at = EXCLUDED.joined_at",
            &[&replica, &interval(lease)],
        )
        .await
        .map_err(|e| self.sorted(e))?;
        tx.commit().await.map_err(|e| self.sorted(e))?;
        Ok(others)
    }

    /// Renews `replica`'s membership for `lease` from now (taking it again if it lapsed: it
    /// then counts as joined now, so it takes nobody's work over until it has been a member
    /// for a whole lease, in which a live owner renews).
    pub async fn renew_membership(&self, replica: &str, lease: Duration) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(
                "INSERT INTO replicas (name, lease_until, joined_at) \
                 VALUES ($1, clock_timestamp() + $2::text::interval, clock_timestamp()) \
                 ON CONFLICT (name) DO UPDATE SET lease_until = EXCLUDED.lease_until, \
                 joined_at = CASE WHEN replicas.lease_until < clock_timestamp() \
                 THEN clock_timestamp() ELSE replicas.joined_at END",
                &[&replica, &interval(lease)],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        Ok(())
    }

    /// Gives `replica`'s membership up (at shutdown).
    pub async fn leave_fleet(&self, replica: &str) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute("DELETE FROM replicas WHERE name = $1", &[&replica])
            .await
            .map_err(|e| self.sorted(e))?;
        Ok(())
    }
}

impl PostgresStore {
    /// The replicas whose membership is live now, by name.
    pub async fn live_members(&self) -> Result<Vec<String>, StoreError> {
        let client = self.client().await?;
        Ok(client
            .query(
                "SELECT name FROM replicas WHERE lease_until >= clock_timestamp() ORDER BY name",
                &[],
            )
            .await
            .map_err(|e| self.sorted(e))?
            .iter()
            .map(|row| row.get::<_, String>(0))
            .collect())
    }

    /// Whether this process's replica runs the fleet's chores now (retention, trimming the
    /// event log): the live member first by name. A process that joined no fleet always does.
    pub async fn leads_fleet(&self) -> Result<bool, StoreError> {
        let Some(me) = self.member.get() else {
            return Ok(true);
        };
        let client = self.client().await?;
        let first: Option<String> = client
            .query_one(
                "SELECT min(name) FROM replicas WHERE lease_until >= clock_timestamp()",
                &[],
            )
            .await
            .map_err(|e| self.sorted(e))?
            .get(0);
        // No live member at all (the lease lapsed with the server away): this one, once it
        // renews, is as good as any.
        Ok(first.is_none_or(|first| &first == me))
    }
}

impl PostgresStore {
    /// Of `replicas`, those that own live operations now.
    pub async fn still_owning(&self, replicas: &[String]) -> Result<Vec<String>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT DISTINCT owner FROM operations \
                 WHERE owner = ANY($1) AND state IN ('pending', 'approved', 'executing')",
                &[&replicas],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        rows.iter().map(|row| column(row, "owner")).collect()
    }

    /// What this store knows of every replica, for one rebuilding the others' work in Redis
    /// (`DurableStore::fleet_rows`): the live members, every owned live operation, and every
    /// owned operation created at or after `since`. Rows no replica owns (written by schema 1)
    /// are left out: the first recovery takes them, and counts them then.
    pub async fn fleet_rows(&self, since: SystemTime) -> Result<FleetRows, StoreError> {
        let members = self.live_members().await?;
        let since = humantime::format_rfc3339_millis(since).to_string();
        let client = self.client().await?;
        let live = client
            .query(
                "SELECT owner, id, client_id, state FROM operations \
                 WHERE state IN ('pending', 'approved', 'executing') AND owner IS NOT NULL",
                &[],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        let created = client
            .query(
                "SELECT owner, client_id, created_at FROM operations \
                 WHERE created_at >= $1 AND owner IS NOT NULL",
                &[&since],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        let mut rows = FleetRows {
            members,
            ..FleetRows::default()
        };
        for row in &live {
            rows.live.push((
                column(row, "owner")?,
                column(row, "id")?,
                column(row, "client_id")?,
                state_column(row, "state")?,
            ));
        }
        for row in &created {
            let at: String = column(row, "created_at")?;
            if let Ok(at) = humantime::parse_rfc3339(&at) {
                rows.created
                    .push((column(row, "owner")?, column(row, "client_id")?, at));
            }
        }
        Ok(rows)
    }

    /// The state each of `ids` has now; an id without a row is left out.
    pub async fn states_of(
        &self,
        ids: &[String],
    ) -> Result<Vec<(String, unyolo_admission::engine::OperationState)>, StoreError> {
        let client = self.client().await?;
        let rows = client
            .query(
                "SELECT id, state FROM operations WHERE id = ANY($1)",
                &[&ids],
            )
            .await
            .map_err(|e| self.sorted(e))?;
        rows.iter()
            .map(|row| Ok((column(row, "id")?, state_column(row, "state")?)))
            .collect()
    }
}
