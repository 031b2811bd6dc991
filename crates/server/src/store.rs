//! Stored responses of the Responses API, in SQLite (WAL journal, synchronous commits: a
//! response is on disk when `store` returns, and a killed server loses none).
//!
//! One row per response; `previous_response_id` links a conversation, and
//! [`ResponseStore::get_chain`] walks it back, returning the records oldest first. Rows carry an
//! expiry (`expires_at`, Unix seconds); reads skip expired rows and
//! [`ResponseStore::cleanup_expired`] deletes them.
use rusqlite::{params, Connection, OptionalExtension};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Retention of a stored response unless the caller sets another: 7 days.
pub const DEFAULT_RETENTION_SECS: i64 = 7 * 24 * 3600;

/// Errors of the response store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("response store {}: {source}", path.display())]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("response store {}: cannot create its directory: {source}", path.display())]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("response {0} not found")]
    NotFound(String),
    #[error("response chain: {link} (previous of {from}) is missing or expired")]
    BrokenChain { from: String, link: String },
    #[error("response chain from {0} loops")]
    Cycle(String),
}

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    pub id: String,
    /// Unix seconds.
    pub created_at: i64,
    pub model: String,
    pub status: String,
    pub instructions: Option<String>,
    /// The request's input items, as JSON.
    pub input_json: String,
    /// The response's output items, as JSON.
    pub output_json: String,
    pub output_text: String,
    pub usage_json: String,
    pub previous_response_id: Option<String>,
    /// Request settings (sampling, tools), as JSON.
    pub config_json: Option<String>,
    /// Unix seconds; `None` = never expires.
    pub expires_at: Option<i64>,
}

/// A [`StoredResponse`] from a query row whose columns are the named fields, in that order.
macro_rules! from_row {
    ($row:expr, $($field:ident),+) => {{
        let mut col = 0usize;
        StoredResponse {
            $($field: {
                col += 1;
                $row.get(col - 1)?
            }),+
        }
    }};
}

/// A SQLite-backed response store (`Send + Sync`; calls take turns on one connection).
pub struct ResponseStore {
    conn: Mutex<Connection>,
    path: PathBuf,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    instructions TEXT,
    input_json TEXT NOT NULL,
    output_json TEXT NOT NULL,
    output_text TEXT NOT NULL,
    usage_json TEXT NOT NULL,
    previous_response_id TEXT,
    config_json TEXT,
    expires_at INTEGER
);
CREATE INDEX IF NOT EXISTS idx_responses_created_at ON responses(created_at);
CREATE INDEX IF NOT EXISTS idx_responses_expires_at ON responses(expires_at);
";

pub fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl ResponseStore {
    /// Open (or create) the store at `path`, creating its parent directory.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir {
                path: path.clone(),
                source,
            })?;
        }
        let err = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let conn = Connection::open(&path).map_err(err)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(err)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .map_err(err)?;
        conn.execute_batch(SCHEMA).map_err(err)?;
        Ok(ResponseStore {
            conn: Mutex::new(conn),
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn err(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Insert or replace a response.
    pub fn store(&self, r: &StoredResponse) -> Result<(), StoreError> {
        self.conn()
            .execute(
                "INSERT OR REPLACE INTO responses (id, created_at, model, status, instructions, input_json, output_json, output_text,
                 usage_json, previous_response_id, config_json, expires_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
                params![
                    r.id,
                    r.created_at,
                    r.model,
                    r.status,
                    r.instructions,
                    r.input_json,
                    r.output_json,
                    r.output_text,
                    r.usage_json,
                    r.previous_response_id,
                    r.config_json,
                    r.expires_at
                ],
            )
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// The response `id`, unless absent or expired.
    pub fn get(&self, id: &str) -> Result<Option<StoredResponse>, StoreError> {
        self.get_at(id, now_secs())
    }

    fn get_at(&self, id: &str, now: i64) -> Result<Option<StoredResponse>, StoreError> {
        self.conn()
            .query_row(
                "SELECT id, created_at, model, status, instructions, input_json, output_json, output_text, usage_json,
                 previous_response_id, config_json, expires_at FROM responses WHERE id = ?1 AND (expires_at IS NULL OR expires_at > ?2)",
                params![id, now],
                |row| {
                    Ok(from_row!(
                        row,
                        id,
                        created_at,
                        model,
                        status,
                        instructions,
                        input_json,
                        output_json,
                        output_text,
                        usage_json,
                        previous_response_id,
                        config_json,
                        expires_at
                    ))
                },
            )
            .optional()
            .map_err(|e| self.err(e))
    }

    /// The conversation ending with `id`: its records oldest first (`id` last). Fails when `id`
    /// or any earlier link is missing or expired.
    pub fn get_chain(&self, id: &str) -> Result<Vec<StoredResponse>, StoreError> {
        let now = now_secs();
        let mut chain = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut next = Some(id.to_string());
        let mut from = id.to_string();
        while let Some(cur) = next {
            if !seen.insert(cur.clone()) {
                return Err(StoreError::Cycle(id.to_string()));
            }
            let r = match self.get_at(&cur, now)? {
                Some(r) => r,
                None if cur == id => return Err(StoreError::NotFound(cur)),
                None => return Err(StoreError::BrokenChain { from, link: cur }),
            };
            from = r.id.clone();
            next = r.previous_response_id.clone();
            chain.push(r);
        }
        chain.reverse();
        Ok(chain)
    }

    /// Delete `id`; whether a row was deleted.
    pub fn delete(&self, id: &str) -> Result<bool, StoreError> {
        let n = self
            .conn()
            .execute("DELETE FROM responses WHERE id = ?1", params![id])
            .map_err(|e| self.err(e))?;
        Ok(n > 0)
    }

    /// Delete every expired response; how many were deleted.
    pub fn cleanup_expired(&self) -> Result<usize, StoreError> {
        self.cleanup_expired_at(now_secs())
    }

    /// [`ResponseStore::cleanup_expired`] as of `now` (Unix seconds).
    pub fn cleanup_expired_at(&self, now: i64) -> Result<usize, StoreError> {
        self.conn()
            .execute(
                "DELETE FROM responses WHERE expires_at IS NOT NULL AND expires_at <= ?1",
                params![now],
            )
            .map_err(|e| self.err(e))
    }

    /// Number of rows (expired ones included).
    pub fn len(&self) -> Result<usize, StoreError> {
        self.conn()
            .query_row("SELECT COUNT(*) FROM responses", [], |r| r.get::<_, i64>(0))
            .map(|n| n as usize)
            .map_err(|e| self.err(e))
    }

    pub fn is_empty(&self) -> Result<bool, StoreError> {
        Ok(self.len()? == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str, prev: Option<&str>, expires_at: Option<i64>) -> StoredResponse {
        StoredResponse {
            id: id.into(),
            created_at: now_secs(),
            model: "m".into(),
            status: "completed".into(),
            instructions: None,
            input_json: "[]".into(),
            output_json: "[]".into(),
            output_text: format!("text of {id}"),
            usage_json: "{}".into(),
            previous_response_id: prev.map(String::from),
            config_json: None,
            expires_at,
        }
    }

    #[test]
    fn chain_is_oldest_first_and_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/responses.db");
        {
            let s = ResponseStore::open(&path).unwrap();
            s.store(&rec("a", None, None)).unwrap();
            s.store(&rec("b", Some("a"), None)).unwrap();
            s.store(&rec("c", Some("b"), Some(now_secs() + 100)))
                .unwrap();
        }
        let s = ResponseStore::open(&path).unwrap();
        let ids: Vec<String> = s
            .get_chain("c")
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect();
        assert_eq!(ids, ["a", "b", "c"]);
        let mode: String = s
            .conn()
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        assert!(s.delete("b").unwrap());
        assert!(!s.delete("b").unwrap());
        assert!(
            matches!(s.get_chain("c"), Err(StoreError::BrokenChain { ref link, .. }) if link == "b")
        );
        assert!(matches!(s.get_chain("zz"), Err(StoreError::NotFound(_))));
    }

    #[test]
    fn expired_rows_are_hidden_then_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        let s = ResponseStore::open(dir.path().join("r.db")).unwrap();
        s.store(&rec("old", None, Some(now_secs() - 1))).unwrap();
        s.store(&rec("new", None, Some(now_secs() + 3600))).unwrap();
        s.store(&rec("forever", None, None)).unwrap();
        assert!(s.get("old").unwrap().is_none());
        assert_eq!(s.get("new").unwrap().unwrap().output_text, "text of new");
        assert_eq!(s.len().unwrap(), 3);
        assert_eq!(s.cleanup_expired().unwrap(), 1);
        assert_eq!(s.len().unwrap(), 2);
        assert_eq!(s.cleanup_expired_at(now_secs() + 7200).unwrap(), 1);
        assert!(s.get("forever").unwrap().is_some());
    }

    #[test]
    fn cycles_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let s = ResponseStore::open(dir.path().join("r.db")).unwrap();
        s.store(&rec("x", Some("y"), None)).unwrap();
        s.store(&rec("y", Some("x"), None)).unwrap();
        assert!(matches!(s.get_chain("x"), Err(StoreError::Cycle(_))));
    }
}
