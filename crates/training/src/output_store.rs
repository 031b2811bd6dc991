//! Recording of GRPO runs in SQLite (mlx-node's OutputStore): every prompt, completion and
//! reward of every step, with the step's metrics; export to JSONL (replayable with the `grpo`
//! example's `--rollouts`) and to XLSX.
//!
//! Schema (one file may hold several runs):
//!
//! ```sql
//! runs(id INTEGER PRIMARY KEY, name TEXT, model TEXT, config_json TEXT, created_at TEXT)
//! steps(run_id, step, loss REAL, reward_mean REAL, reward_std REAL, metrics_json TEXT,
//!       PRIMARY KEY (run_id, step))
//! generations(id INTEGER PRIMARY KEY, run_id, step, group_id, prompt TEXT, completion TEXT,
//!             prompt_ids TEXT, completion_ids TEXT, reward REAL, rewards_json TEXT,
//!             advantage REAL, finish_reason TEXT)
//! ```
//!
//! `prompt_ids`/`completion_ids` are JSON arrays; `rewards_json` maps reward function names to
//! scores (null where one did not apply); `group_id` numbers the run's groups from 0 in the order
//! they were recorded. A step and its generations are written in one transaction.
use crate::error::{Result, TrainError};
use rusqlite::{params, Connection, OptionalExtension};
use std::path::Path;

fn db_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Store(e.to_string())
}

/// One recorded completion.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GenerationRecord {
    /// The run's group this completion belongs to (completions of one prompt in one step).
    pub group_id: i64,
    pub prompt: String,
    pub completion: String,
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// Combined reward (NaN: unscorable).
    pub reward: f64,
    /// Each reward function's score by name (NaN where it did not apply).
    pub rewards: Vec<(String, f64)>,
    pub advantage: f64,
    /// Why sampling stopped (`stop`, `length`, ...); `recorded` for replayed rollouts.
    pub finish_reason: String,
}

/// A recorded completion with its run and step.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredGeneration {
    pub run_id: i64,
    pub step: u64,
    pub record: GenerationRecord,
}

/// An output store: a SQLite database file.
pub struct OutputStore {
    conn: Connection,
}

fn nan_to_null(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// The rewards by function as a JSON object (null where not finite).
fn rewards_object(rewards: &[(String, f64)]) -> serde_json::Value {
    serde_json::Value::Object(rewards.iter().map(|(n, v)| (n.clone(), nan_to_null(*v).map_or(serde_json::Value::Null, |x| x.into()))).collect())
}

impl OutputStore {
    /// Open (creating when needed) the store at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let conn = Connection::open(path)
            .map_err(|e| TrainError::Store(format!("{}: {e}", path.display())))?;
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY, name TEXT NOT NULL, model TEXT NOT NULL,
                 config_json TEXT NOT NULL, created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP);
             CREATE TABLE IF NOT EXISTS steps (run_id INTEGER NOT NULL REFERENCES runs(id), step INTEGER NOT NULL,
                 loss REAL, reward_mean REAL, reward_std REAL, metrics_json TEXT NOT NULL, PRIMARY KEY (run_id, step));
             CREATE TABLE IF NOT EXISTS generations (id INTEGER PRIMARY KEY, run_id INTEGER NOT NULL REFERENCES runs(id),
                 step INTEGER NOT NULL, group_id INTEGER NOT NULL, prompt TEXT NOT NULL, completion TEXT NOT NULL,
                 prompt_ids TEXT NOT NULL, completion_ids TEXT NOT NULL, reward REAL, rewards_json TEXT NOT NULL,
                 advantage REAL, finish_reason TEXT NOT NULL);
             CREATE INDEX IF NOT EXISTS generations_run_step ON generations(run_id, step);",
        )
        .map_err(db_err)?;
        Ok(OutputStore { conn })
    }

    /// Start a run; returns its id.
    pub fn start_run(
        &self,
        name: &str,
        model: &str,
        config_json: &serde_json::Value,
    ) -> Result<i64> {
        self.conn
            .execute(
                "INSERT INTO runs (name, model, config_json) VALUES (?1, ?2, ?3)",
                params![name, model, config_json.to_string()],
            )
            .map_err(db_err)?;
        Ok(self.conn.last_insert_rowid())
    }

    /// The latest run's id, if any.
    pub fn latest_run(&self) -> Result<Option<i64>> {
        self.conn
            .query_row("SELECT MAX(id) FROM runs", [], |r| {
                r.get::<_, Option<i64>>(0)
            })
            .optional()
            .map(|o| o.flatten())
            .map_err(db_err)
    }

    /// Whether the store holds run `run`.
    pub fn has_run(&self, run: i64) -> Result<bool> {
        self.conn
            .query_row("SELECT COUNT(*) FROM runs WHERE id = ?1", [run], |r| {
                r.get::<_, i64>(0)
            })
            .map(|n| n > 0)
            .map_err(db_err)
    }

    /// Delete the steps of `run` after `step` and their generations (what a run resumed from
    /// an earlier checkpoint redoes); returns the number of generations deleted.
    pub fn truncate_run(&mut self, run: i64, step: u64) -> Result<usize> {
        let tx = self.conn.transaction().map_err(db_err)?;
        tx.execute(
            "DELETE FROM steps WHERE run_id = ?1 AND step > ?2",
            params![run, step as i64],
        )
        .map_err(db_err)?;
        let n = tx
            .execute(
                "DELETE FROM generations WHERE run_id = ?1 AND step > ?2",
                params![run, step as i64],
            )
            .map_err(db_err)?;
        tx.commit().map_err(db_err)?;
        Ok(n)
    }

    /// The next unused group id of `run` (0 for a new run).
    pub fn next_group_id(&self, run: i64) -> Result<i64> {
        self.conn
            .query_row(
                "SELECT COALESCE(MAX(group_id) + 1, 0) FROM generations WHERE run_id = ?1",
                [run],
                |r| r.get(0),
            )
            .map_err(db_err)
    }

    /// Record step `step` of `run`: its metrics (any serialisable value; `loss`, `reward_mean`
    /// and `reward_std` are read from it) and its completions, in one transaction.
    pub fn record_step(
        &mut self,
        run: i64,
        step: u64,
        metrics: &impl serde::Serialize,
        records: &[GenerationRecord],
    ) -> Result<()> {
        let m = serde_json::to_value(metrics).map_err(db_err)?;
        let f = |k: &str| m.get(k).and_then(|v| v.as_f64());
        let tx = self.conn.transaction().map_err(db_err)?;
        tx.execute(
            "INSERT INTO steps (run_id, step, loss, reward_mean, reward_std, metrics_json) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![run, step as i64, f("loss"), f("reward_mean"), f("reward_std"), m.to_string()],
        )
        .map_err(db_err)?;
        {
            let mut ins = tx
                .prepare("INSERT INTO generations (run_id, step, group_id, prompt, completion, prompt_ids, completion_ids, reward, rewards_json, advantage, finish_reason) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)")
                .map_err(db_err)?;
            for r in records {
                ins.execute(params![
                    run,
                    step as i64,
                    r.group_id,
                    r.prompt,
                    r.completion,
                    serde_json::to_string(&r.prompt_ids).map_err(db_err)?,
                    serde_json::to_string(&r.completion_ids).map_err(db_err)?,
                    nan_to_null(r.reward),
                    rewards_object(&r.rewards).to_string(),
                    nan_to_null(r.advantage),
                    r.finish_reason,
                ])
                .map_err(db_err)?;
            }
        }
        tx.commit().map_err(db_err)
    }

    /// The recorded completions of `run` (every run when `None`), in recording order.
    pub fn generations(&self, run: Option<i64>) -> Result<Vec<StoredGeneration>> {
        let mut stmt = self
            .conn
            .prepare("SELECT run_id, step, group_id, prompt, completion, prompt_ids, completion_ids, reward, rewards_json, advantage, finish_reason FROM generations WHERE ?1 IS NULL OR run_id = ?1 ORDER BY id")
            .map_err(db_err)?;
        let rows = stmt
            .query_map([run], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, String>(4)?,
                    r.get::<_, String>(5)?,
                    r.get::<_, String>(6)?,
                    r.get::<_, Option<f64>>(7)?,
                    r.get::<_, String>(8)?,
                    r.get::<_, Option<f64>>(9)?,
                    r.get::<_, String>(10)?,
                ))
            })
            .map_err(db_err)?;
        let mut out = Vec::new();
        for row in rows {
            let (run_id, step, group_id, prompt, completion, pids, cids, reward, rj, adv, finish) =
                row.map_err(db_err)?;
            let rewards: serde_json::Map<String, serde_json::Value> =
                serde_json::from_str(&rj).map_err(db_err)?;
            out.push(StoredGeneration {
                run_id,
                step: step as u64,
                record: GenerationRecord {
                    group_id,
                    prompt,
                    completion,
                    prompt_ids: serde_json::from_str(&pids).map_err(db_err)?,
                    completion_ids: serde_json::from_str(&cids).map_err(db_err)?,
                    reward: reward.unwrap_or(f64::NAN),
                    rewards: rewards
                        .into_iter()
                        .map(|(k, v)| (k, v.as_f64().unwrap_or(f64::NAN)))
                        .collect(),
                    advantage: adv.unwrap_or(f64::NAN),
                    finish_reason: finish,
                },
            });
        }
        Ok(out)
    }

    /// Write `run`'s completions (every run's when `None`) to `path` as JSONL, atomically: one
    /// object a line with the `--rollouts` keys `group`, `prompt_ids`, `completion_ids`, `reward`
    /// (null when unscorable) and `run`, `step`, `prompt`, `completion`, `rewards`, `advantage`,
    /// `finish_reason`. Returns the number of lines.
    pub fn export_jsonl(&self, run: Option<i64>, path: &Path) -> Result<usize> {
        let rows = self.generations(run)?;
        let mut text = String::new();
        for g in &rows {
            let r = &g.record;
            let rewards = rewards_object(&r.rewards);
            let line = serde_json::json!({
                "group": r.group_id, "prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids, "reward": nan_to_null(r.reward),
                "run": g.run_id, "step": g.step, "prompt": r.prompt, "completion": r.completion, "rewards": rewards,
                "advantage": nan_to_null(r.advantage), "finish_reason": r.finish_reason,
            });
            text.push_str(&line.to_string());
            text.push('\n');
        }
        mlx_array::io::write_atomic(path, text.as_bytes())?;
        Ok(rows.len())
    }

    /// Write `run`'s completions (every run's when `None`) to `path` as an XLSX workbook,
    /// atomically: sheet `generations` (run, step, group, prompt, completion, reward, advantage,
    /// finish reason, then one column per reward function) and sheet `steps` (run, step, loss,
    /// reward mean and std). Cells hold at most 32767 characters (Excel's limit): longer texts
    /// are cut there. Returns the number of generation rows.
    pub fn export_xlsx(&self, run: Option<i64>, path: &Path) -> Result<usize> {
        use rust_xlsxwriter::Workbook;
        let x = |e: rust_xlsxwriter::XlsxError| TrainError::Store(format!("xlsx: {e}"));
        let cut = |s: &str| -> String { s.chars().take(32767).collect() };
        let rows = self.generations(run)?;
        let mut names: Vec<String> = Vec::new();
        for g in &rows {
            for (n, _) in &g.record.rewards {
                if !names.contains(n) {
                    names.push(n.clone());
                }
            }
        }
        let mut wb = Workbook::new();
        let ws = wb.add_worksheet();
        ws.set_name("generations").map_err(x)?;
        let header = [
            "run",
            "step",
            "group",
            "prompt",
            "completion",
            "reward",
            "advantage",
            "finish_reason",
        ];
        for (c, h) in header
            .iter()
            .map(|h| h.to_string())
            .chain(names.iter().cloned())
            .enumerate()
        {
            ws.write_string(0, c as u16, h).map_err(x)?;
        }
        for (i, g) in rows.iter().enumerate() {
            let row = i as u32 + 1;
            let r = &g.record;
            ws.write_number(row, 0, g.run_id as f64).map_err(x)?;
            ws.write_number(row, 1, g.step as f64).map_err(x)?;
            ws.write_number(row, 2, r.group_id as f64).map_err(x)?;
            ws.write_string(row, 3, cut(&r.prompt)).map_err(x)?;
            ws.write_string(row, 4, cut(&r.completion)).map_err(x)?;
            for (c, v) in [(5u16, r.reward), (6, r.advantage)] {
                if v.is_finite() {
                    ws.write_number(row, c, v).map_err(x)?;
                }
            }
            ws.write_string(row, 7, r.finish_reason.clone())
                .map_err(x)?;
            for (k, n) in names.iter().enumerate() {
                if let Some((_, v)) = r
                    .rewards
                    .iter()
                    .find(|(m, _)| m == n)
                    .filter(|(_, v)| v.is_finite())
                {
                    ws.write_number(row, 8 + k as u16, *v).map_err(x)?;
                }
            }
        }
        let steps = wb.add_worksheet();
        steps.set_name("steps").map_err(x)?;
        for (c, h) in ["run", "step", "loss", "reward_mean", "reward_std"]
            .iter()
            .enumerate()
        {
            steps.write_string(0, c as u16, *h).map_err(x)?;
        }
        let mut stmt = self.conn.prepare("SELECT run_id, step, loss, reward_mean, reward_std FROM steps WHERE ?1 IS NULL OR run_id = ?1 ORDER BY run_id, step").map_err(db_err)?;
        let srows = stmt
            .query_map([run], |r| {
                Ok([
                    r.get::<_, i64>(0)? as f64,
                    r.get::<_, i64>(1)? as f64,
                    r.get::<_, Option<f64>>(2)?.unwrap_or(f64::NAN),
                    r.get::<_, Option<f64>>(3)?.unwrap_or(f64::NAN),
                    r.get::<_, Option<f64>>(4)?.unwrap_or(f64::NAN),
                ])
            })
            .map_err(db_err)?;
        for (i, row) in srows.enumerate() {
            for (c, v) in row.map_err(db_err)?.iter().enumerate() {
                if v.is_finite() {
                    steps.write_number(i as u32 + 1, c as u16, *v).map_err(x)?;
                }
            }
        }
        let bytes = wb.save_to_buffer().map_err(x)?;
        mlx_array::io::write_atomic(path, &bytes)?;
        Ok(rows.len())
    }
}
