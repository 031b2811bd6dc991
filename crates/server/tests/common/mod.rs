//! A `mlx-serve` process on 127.0.0.1 (random port) and a minimal HTTP/1.1 client.
#![allow(dead_code)]
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/tiny")
        .join(name)
}

pub struct Server {
    child: Child,
    pub port: u16,
}

impl Server {
    pub fn start(model: &Path, db: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mlx-serve"))
            .arg("--model")
            .arg(model)
            .args(["--port", "0", "--db"])
            .arg(db)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn mlx-serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("read the listening line");
        let port = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {line:?}"));
        Server { child, port }
    }

    /// SIGKILL (no graceful shutdown).
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn req(&self, method: &str, path: &str, body: Option<&str>) -> Resp {
        request(self.port, method, path, body)
    }
    pub fn post(&self, path: &str, body: &Value) -> Resp {
        self.req("POST", path, Some(&body.to_string()))
    }
    pub fn get(&self, path: &str) -> Resp {
        self.req("GET", path, None)
    }
    pub fn metric(&self, name: &str) -> f64 {
        let m = self.get("/metrics").body;
        m.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|r| r.strip_prefix(' '))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or_else(|| panic!("no metric {name} in\n{m}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Resp {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
    /// `data:` payloads of a server-sent event stream.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|ev| {
                ev.lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .map(String::from)
            })
            .collect()
    }
    /// (`event:` name, data) pairs.
    pub fn sse_events(&self) -> Vec<(String, Value)> {
        self.body
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|ev| {
                let name = ev
                    .lines()
                    .find_map(|l| l.strip_prefix("event: "))
                    .unwrap_or("")
                    .to_string();
                let data = ev
                    .lines()
                    .find_map(|l| l.strip_prefix("data: "))
                    .unwrap_or("null");
                (name, serde_json::from_str(data).unwrap())
            })
            .collect()
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(nl) = raw.windows(2).position(|w| w == b"\r\n") else {
            break;
        };
        let size =
            usize::from_str_radix(std::str::from_utf8(&raw[..nl]).unwrap().trim(), 16).unwrap();
        raw = &raw[nl + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
    out
}

pub fn connect(port: u16, method: &str, path: &str, body: Option<&str>) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.unwrap_or("");
    write!(s, "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    s
}

pub fn request(port: u16, method: &str, path: &str, body: Option<&str>) -> Resp {
    let mut s = connect(port, method, path, body);
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let headers = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = headers.split_whitespace().nth(1).unwrap().parse().unwrap();
    let rest = &raw[split + 4..];
    let body = if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Resp {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
    }
}
