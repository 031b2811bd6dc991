// Tiny flag parser shared by the examples (`--name value` and boolean `--flag`).
#![allow(dead_code)]
use std::collections::HashMap;

pub struct Args {
    vals: HashMap<String, String>,
    flags: std::collections::HashSet<String>,
}

impl Args {
    /// `bool_flags` take no value.
    pub fn parse(bool_flags: &[&str]) -> Result<Self, String> {
        let mut it = std::env::args().skip(1);
        let (mut vals, mut flags) = (HashMap::new(), std::collections::HashSet::new());
        while let Some(a) = it.next() {
            let name = a.strip_prefix("--").ok_or_else(|| format!("unexpected argument {a:?}"))?.to_string();
            if bool_flags.contains(&name.as_str()) {
                flags.insert(name);
            } else {
                let v = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
                vals.insert(name, v);
            }
        }
        Ok(Args { vals, flags })
    }
    pub fn get(&self, k: &str) -> Option<&str> {
        self.vals.get(k).map(|s| s.as_str())
    }
    pub fn flag(&self, k: &str) -> bool {
        self.flags.contains(k)
    }
    pub fn num<T: std::str::FromStr>(&self, k: &str, default: T) -> Result<T, String> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("--{k}: cannot parse {v:?}")),
        }
    }
    pub fn ids(&self, k: &str) -> Result<Option<Vec<u32>>, String> {
        self.get(k)
            .map(|s| s.split(',').map(|x| x.trim().parse::<u32>().map_err(|_| format!("--{k}: bad token id {x:?}"))).collect())
            .transpose()
    }
}
