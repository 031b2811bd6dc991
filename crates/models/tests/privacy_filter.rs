//! `PrivacyFilterModel` against the transformers fixture made by
//! `scripts/make_privacy_filter_fixture.py` (tests/fixtures/tiny/privacy_filter): logits parity,
//! the decoded tags and spans of the generator's NumPy decoder, byte offsets on multi-byte text,
//! calibration overrides, thresholds, option and directory errors; and the Viterbi decoder against
//! brute-force enumeration of every legal path.
mod common;

use mlx_array::DType;
use mlx_models::privacy::viterbi::{spans, viterbi};
use mlx_models::privacy::{Calibration, CalibrationOverrides, ClassifyOptions, PrivacyEntity, PrivacyError, PrivacyFilterModel, TagSet};
use mlx_models::ModelError;
use serde_json::Value;
use std::path::Path;

const FIXTURE: &str = "privacy_filter";

fn model() -> PrivacyFilterModel {
    PrivacyFilterModel::load(common::fixture(FIXTURE)).unwrap()
}

fn reference_json() -> Value {
    serde_json::from_str(&std::fs::read_to_string(common::fixture(FIXTURE).join("reference.json")).unwrap()).unwrap()
}

fn text() -> String {
    reference_json()["text"].as_str().unwrap().to_string()
}

fn all_spans() -> ClassifyOptions {
    ClassifyOptions { threshold: 0.0, return_tokens: true, ..Default::default() }
}

fn overrides_of(reference: &Value) -> CalibrationOverrides {
    let o = &reference["override"];
    let get = |k: &str| o.get(k).map(|v| v.as_f64().unwrap() as f32);
    CalibrationOverrides {
        background_stay: get("transition_bias_background_stay"),
        background_to_start: get("transition_bias_background_to_start"),
        end_to_background: get("transition_bias_end_to_background"),
        end_to_start: get("transition_bias_end_to_start"),
        inside_to_continue: get("transition_bias_inside_to_continue"),
        inside_to_end: get("transition_bias_inside_to_end"),
    }
}

/// Relative error bound of the logits against transformers' f32 eager reference.
const LOGITS_TOL: f32 = 1e-4;
/// Absolute bound on span scores (means of probabilities) against the NumPy decoder's.
const SCORE_TOL: f32 = 1e-4;

#[test]
fn tokens_and_logits_match_transformers() {
    let m = model();
    let r = reference_json();
    let text = text();
    let enc = m.tokenizer().inner().encode(text.as_str(), false).unwrap();
    let want_ids: Vec<u32> = r["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    assert_eq!(enc.get_ids(), want_ids.as_slice());
    let want_off: Vec<(usize, usize)> =
        r["offsets"].as_array().unwrap().iter().map(|p| (p[0].as_u64().unwrap() as usize, p[1].as_u64().unwrap() as usize)).collect();
    assert_eq!(enc.get_offsets(), want_off.as_slice(), "byte offsets differ from the Python binding's (converted to bytes)");

    let refs = common::reference(FIXTURE);
    assert_eq!(common::ids(&refs["input_ids"]), want_ids);
    let want = refs["logits"].to_vec::<f32>().unwrap();
    let got = m.logits(&want_ids).unwrap();
    assert_eq!(got.shape(), vec![1, want_ids.len(), 33]);
    assert_eq!(got.dtype(), DType::F32);
    let err = common::rel_err(&got.to_vec::<f32>().unwrap(), &want);
    println!("privacy_filter logits: {} tokens, max rel err {err:.3e} (bound {LOGITS_TOL:e})", want_ids.len());
    assert!(err <= LOGITS_TOL, "logits rel err {err}");
    // the band matters: the prompt is much longer than the window, and its queries run in
    // several blocks
    let window = r["sliding_window"].as_u64().unwrap() as usize;
    assert!(window * 4 < want_ids.len() && mlx_models::privacy::model::query_block(window) < want_ids.len());

    // a text shorter than the window: every key visible
    let short = r["short_text"].as_str().unwrap();
    let short_ids = m.tokenizer().inner().encode(short, false).unwrap().get_ids().to_vec();
    assert_eq!(short_ids, common::ids(&refs["short_input_ids"]));
    assert!(short_ids.len() <= window + 1);
    let got = m.logits(&short_ids).unwrap().to_vec::<f32>().unwrap();
    let err = common::rel_err(&got, &refs["short_logits"].to_vec::<f32>().unwrap());
    println!("privacy_filter short-text logits: {} tokens, max rel err {err:.3e}", short_ids.len());
    assert!(err <= LOGITS_TOL, "short-text logits rel err {err}");
}

fn check_decode(got: &mlx_models::privacy::ClassifyResult, want: &Value, text: &str) {
    let tags: Vec<&str> = want["tags"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let got_tags: Vec<&str> = got.tokens.as_ref().unwrap().iter().map(|t| t.tag.as_str()).collect();
    assert_eq!(got_tags, tags);
    let want_e = want["entities"].as_array().unwrap();
    assert_eq!(got.entities.len(), want_e.len(), "{:?}", got.entities);
    for (g, w) in got.entities.iter().zip(want_e) {
        assert_eq!(g.label, w["label"].as_str().unwrap());
        assert_eq!((g.start, g.end), (w["start"].as_u64().unwrap() as usize, w["end"].as_u64().unwrap() as usize));
        assert_eq!(g.text, w["text"].as_str().unwrap());
        assert_eq!(g.text, &text[g.start..g.end]);
        let ws = w["score"].as_f64().unwrap() as f32;
        assert!((g.score - ws).abs() <= SCORE_TOL, "{} score {} vs {ws}", g.label, g.score);
    }
}

#[test]
fn decoding_matches_the_reference_decoder_and_overrides_change_it() {
    let m = model();
    let r = reference_json();
    let text = text();
    let default = m.classify(&text, &all_spans()).unwrap();
    check_decode(&default, &r["decoded"]["default"], &text);
    let over = overrides_of(&r);
    let overridden = m.classify(&text, &ClassifyOptions { calibration: over, ..all_spans() }).unwrap();
    check_decode(&overridden, &r["decoded"]["override"], &text);
    assert_ne!(default.tokens, overridden.tokens, "the override must change the decoded tags");
    assert_ne!(default.entities, overridden.entities);
    // the file's calibration is what an empty override gives
    assert_eq!(m.calibration().background_stay, 0.3);
    assert_eq!(CalibrationOverrides::default().apply(m.calibration()).unwrap(), *m.calibration());
}

#[test]
fn threshold_keeps_spans_whose_mean_score_clears_it() {
    let m = model();
    let text = text();
    let over = overrides_of(&reference_json());
    let all = m.classify(&text, &ClassifyOptions { calibration: over, ..all_spans() }).unwrap().entities;
    assert!(all.len() >= 3, "{all:?}");
    let mut scores: Vec<f32> = all.iter().map(|e| e.score).collect();
    scores.sort_by(f32::total_cmp);
    let thr = (scores[0] + scores[scores.len() - 1]) / 2.0;
    assert!(scores[0] < thr && thr < scores[scores.len() - 1]);
    for t in [thr, 0.5, 1.0] {
        let got = m.classify(&text, &ClassifyOptions { threshold: t, calibration: over, return_tokens: false }).unwrap();
        let want: Vec<PrivacyEntity> = all.iter().filter(|e| e.score >= t).cloned().collect();
        assert_eq!(got.entities, want, "threshold {t}");
        assert!(got.tokens.is_none());
    }
    // the default threshold is 0.5
    let d = m.classify(&text, &ClassifyOptions { calibration: over, ..Default::default() }).unwrap();
    assert_eq!(d.entities, all.iter().filter(|e| e.score >= 0.5).cloned().collect::<Vec<_>>());
    assert_eq!(ClassifyOptions::default().threshold, 0.5);
    assert!(!ClassifyOptions::default().return_tokens);
}

#[test]
fn byte_offsets_slice_multibyte_text() {
    let m = model();
    let text = text();
    let over = overrides_of(&reference_json());
    let res = m.classify(&text, &ClassifyOptions { calibration: over, ..all_spans() }).unwrap();
    let toks = res.tokens.unwrap();
    assert_eq!(toks.first().unwrap().start, 0);
    assert_eq!(toks.last().unwrap().end, text.len());
    let mut multibyte = 0;
    for t in &toks {
        assert_eq!(t.text, &text[t.start..t.end]);
        assert!((0.0..=1.0).contains(&t.score));
        if t.text.chars().count() == 1 && t.text.len() > 1 {
            multibyte += 1;
        }
    }
    assert!(multibyte >= 4, "the fixture text has multi-byte characters split across byte-level tokens");
    // byte, not character, offsets: the text has non-ASCII characters before its last entity
    assert!(text.len() > text.chars().count());
    let mut beyond_ascii = false;
    for e in &res.entities {
        assert_eq!(e.text, &text[e.start..e.end]);
        assert!(toks.iter().any(|t| t.start == e.start) && toks.iter().any(|t| t.end == e.end));
        beyond_ascii |= !text[..e.start].is_ascii();
    }
    assert!(beyond_ascii, "some entity starts after a multi-byte character");
    // entities rebuilt from the per-token tags: B…E / S runs, offsets of their first and last
    // tokens, score the mean of their token scores
    let mut want = Vec::new();
    let mut open: Option<usize> = None;
    for (i, t) in toks.iter().enumerate() {
        match t.tag.split_once('-').map(|(p, _)| p) {
            Some("B") => open = Some(i),
            Some("S") => want.push((i, i)),
            Some("E") => want.push((open.take().unwrap(), i)),
            _ => {}
        }
    }
    assert_eq!(want.len(), res.entities.len());
    for ((a, z), e) in want.into_iter().zip(&res.entities) {
        assert_eq!((e.start, e.end), (toks[a].start, toks[z].end));
        assert_eq!(e.label, toks[a].tag[2..]);
        let mean = toks[a..=z].iter().map(|t| t.score as f64).sum::<f64>() / (z - a + 1) as f64;
        assert!((mean as f32 - e.score).abs() < 1e-6, "{e:?} vs {mean}");
    }
}

#[test]
fn options_are_validated_and_empty_text_has_no_entities() {
    let m = model();
    for t in [f32::NAN, -0.01, 1.5, f32::INFINITY] {
        let e = m.classify("hello", &ClassifyOptions { threshold: t, ..Default::default() }).unwrap_err();
        assert!(matches!(e, ModelError::Privacy(PrivacyError::Threshold(_))), "{t}: {e}");
    }
    let bad = CalibrationOverrides { inside_to_end: Some(f32::NEG_INFINITY), ..Default::default() };
    let e = m.classify("hello", &ClassifyOptions { calibration: bad, ..Default::default() }).unwrap_err();
    assert!(matches!(e, ModelError::Privacy(PrivacyError::Override { name: "transition_bias_inside_to_end", .. })), "{e}");
    let r = m.classify("", &all_spans()).unwrap();
    assert!(r.entities.is_empty());
    assert_eq!(r.tokens, Some(vec![]));
    assert!(m.classify("", &ClassifyOptions::default()).unwrap().tokens.is_none());
    assert!(matches!(m.logits(&[]).unwrap_err(), ModelError::InvalidInput(_)));
    assert!(matches!(m.logits(&[1, 100_000]).unwrap_err(), ModelError::InvalidInput(_)));
}

#[test]
fn model_is_send() {
    fn send<T: Send>(_: &T) {}
    let m = model();
    send(&m);
    // first use on another thread than the loading one
    let (got, m) = std::thread::spawn(move || (m.classify(&text(), &all_spans()).unwrap(), m)).join().unwrap();
    assert_eq!(got, m.classify(&text(), &all_spans()).unwrap());
}

/// A copy of the fixture with `edit` applied to it.
fn broken(edit: impl FnOnce(&Path)) -> Result<PrivacyFilterModel, ModelError> {
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(common::fixture(FIXTURE)).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    edit(dir.path());
    PrivacyFilterModel::load(dir.path())
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn broken_directories_are_typed_errors() {
    let e = broken(|d| std::fs::remove_file(d.join("config.json")).unwrap()).unwrap_err();
    assert!(matches!(e, ModelError::ConfigNotFound(_)), "{e}");
    let e = broken(|d| std::fs::write(d.join("config.json"), "{not json").unwrap()).unwrap_err();
    assert!(matches!(e, ModelError::MalformedConfig { .. }), "{e}");
    let e = broken(|d| edit_json(&d.join("config.json"), |v| v["model_type"] = "gpt_oss".into())).unwrap_err();
    assert!(matches!(e, ModelError::UnsupportedModelType { .. }), "{e}");
    let e = broken(|d| edit_json(&d.join("config.json"), |v| v.as_object_mut().unwrap().remove("hidden_size").map(|_| ()).unwrap())).unwrap_err();
    assert!(matches!(e, ModelError::MalformedConfig { .. }), "{e}");
    // shapes transformers could not build, and an unknown rope type
    for (k, v) in [("num_key_value_heads", Value::from(3)), ("num_experts_per_tok", 5.into()), ("head_dim", 15.into())] {
        let e = broken(|d| edit_json(&d.join("config.json"), |c| c[k] = v)).unwrap_err();
        assert!(matches!(e, ModelError::MalformedConfig { .. }), "{k}: {e}");
    }
    let e = broken(|d| edit_json(&d.join("config.json"), |c| c["rope_parameters"]["rope_type"] = "su".into())).unwrap_err();
    assert!(matches!(e, ModelError::MalformedConfig { .. }) && e.to_string().contains("\"su\""), "{e}");
    // a tensor no module reads
    let e = broken(|d| {
        let p = d.join("model.safetensors");
        let mut t = mlx_array::io::load_safetensors(&p, None).unwrap();
        t.insert("model.layers.0.mlp.experts.extra".into(), mlx_array::Array::zeros(&[2], DType::F32).unwrap());
        let refs: Vec<(&str, &mlx_array::Array)> = t.iter().map(|(k, v)| (k.as_str(), v)).collect();
        mlx_array::io::save_safetensors(&p, &refs, None).unwrap();
    })
    .unwrap_err();
    assert!(matches!(&e, ModelError::Checkpoint { msg, .. } if msg.contains("experts.extra")), "{e}");
    // id2label: a gap, a bad prefix, a missing E-, two O labels
    let e = broken(|d| edit_json(&d.join("config.json"), |v| {
        let m = v["id2label"].as_object_mut().unwrap();
        let x = m.remove("32").unwrap();
        m.insert("40".into(), x);
    }))
    .unwrap_err();
    assert!(matches!(e, ModelError::Privacy(PrivacyError::Labels(_))), "{e}");
    for (id, label) in [("5", "X-private_address"), ("3", "I-account_numbers"), ("7", "O")] {
        let e = broken(|d| edit_json(&d.join("config.json"), |v| v["id2label"][id] = label.into())).unwrap_err();
        assert!(matches!(e, ModelError::Privacy(PrivacyError::Labels(_))), "{label}: {e}");
    }
    // a label set of the wrong size for the score head
    let e = broken(|d| edit_json(&d.join("config.json"), |v| {
        let m = v["id2label"].as_object_mut().unwrap();
        for k in 29..33 {
            m.remove(&k.to_string());
        }
        v.as_object_mut().unwrap().remove("label2id");
    }))
    .unwrap_err();
    assert!(matches!(e, ModelError::Checkpoint { .. }), "{e}");
    // calibration: missing bias, non-number, unknown key, not JSON
    for edit in [
        r#"{"operating_points": {"default": {"biases": {"transition_bias_background_stay": 0.1}}}}"#,
        r#"{"operating_points": {"default": {"biases": {"transition_bias_background_stay": "x", "transition_bias_background_to_start": 0, "transition_bias_end_to_background": 0, "transition_bias_end_to_start": 0, "transition_bias_inside_to_continue": 0, "transition_bias_inside_to_end": 0}}}}"#,
        r#"{"operating_points": {"default": {"biases": {"transition_bias_typo": 1, "transition_bias_background_stay": 0, "transition_bias_background_to_start": 0, "transition_bias_end_to_background": 0, "transition_bias_end_to_start": 0, "transition_bias_inside_to_continue": 0, "transition_bias_inside_to_end": 0}}}}"#,
        r#"{"biases": {}}"#,
        "[",
    ] {
        let e = broken(|d| std::fs::write(d.join("viterbi_calibration.json"), edit).unwrap()).unwrap_err();
        assert!(matches!(e, ModelError::Privacy(PrivacyError::Calibration { .. })), "{edit}: {e}");
    }
    let e = broken(|d| std::fs::remove_file(d.join("tokenizer.json")).unwrap()).unwrap_err();
    assert!(matches!(e, ModelError::Chat(mlx_models::chat::ChatError::TokenizerNotFound(_))), "{e}");
    let e = broken(|d| std::fs::remove_file(d.join("model.safetensors")).unwrap()).unwrap_err();
    assert!(matches!(e, ModelError::Checkpoint { .. }), "{e}");
    // without a calibration file every bias is 0
    let m = broken(|d| std::fs::remove_file(d.join("viterbi_calibration.json")).unwrap()).unwrap();
    assert_eq!(*m.calibration(), Calibration::default());
}

// ---- Viterbi against brute force -------------------------------------------------------------

/// xorshift64*: a reproducible stream without extra dependencies.
struct Rng(u64);
impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545F4914F6CDD1D) >> 40) as f32) / (1u64 << 24) as f32
    }
    fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.next_f32()
    }
}

/// The bias of `a → b` written from the label strings (independently of the library's tables);
/// `None` for transitions BIOES forbids. `b` = the six biases in `Calibration::KEYS` order.
fn bias(a: &str, b: &str, w: &[f32; 6]) -> Option<f32> {
    let split = |l: &str| -> (char, String) {
        if l == "O" { ('O', String::new()) } else { (l.chars().next().unwrap(), l[2..].to_string()) }
    };
    let ((pa, la), (pb, lb)) = (split(a), split(b));
    match pa {
        'O' => match pb {
            'O' => Some(w[0]),
            'B' | 'S' => Some(w[1]),
            _ => None,
        },
        'B' | 'I' => match pb {
            'I' if la == lb => Some(w[4]),
            'E' if la == lb => Some(w[5]),
            _ => None,
        },
        _ => match pb {
            'O' => Some(w[2]),
            'B' | 'S' => Some(w[3]),
            _ => None,
        },
    }
}

/// The best legal path by enumerating all `n^T` label sequences.
fn brute_force(labels: &[String], em: &[f32], t_len: usize, w: &[f32; 6]) -> (Vec<usize>, f64) {
    let n = labels.len();
    let (mut best, mut best_path) = (f64::NEG_INFINITY, Vec::new());
    let mut path = vec![0usize; t_len];
    for code in 0..n.pow(t_len as u32) {
        let mut c = code;
        for p in path.iter_mut() {
            *p = c % n;
            c /= n;
        }
        let first = labels[path[0]].chars().next().unwrap();
        let last = labels[path[t_len - 1]].chars().next().unwrap();
        if !matches!(first, 'O' | 'B' | 'S') || !matches!(last, 'O' | 'E' | 'S') {
            continue;
        }
        let mut s = 0f64;
        let mut legal = true;
        for t in 0..t_len {
            s += em[t * n + path[t]] as f64;
            if t > 0 {
                match bias(&labels[path[t - 1]], &labels[path[t]], w) {
                    Some(b) => s += b as f64,
                    None => {
                        legal = false;
                        break;
                    }
                }
            }
        }
        if legal && s > best {
            (best, best_path) = (s, path.clone());
        }
    }
    (best_path, best)
}

fn score_of(labels: &[String], em: &[f32], path: &[usize], w: &[f32; 6]) -> f64 {
    let n = labels.len();
    let mut s = 0f64;
    for t in 0..path.len() {
        s += em[t * n + path[t]] as f64;
        if t > 0 {
            s += bias(&labels[path[t - 1]], &labels[path[t]], w).expect("decoder returned an illegal transition") as f64;
        }
    }
    s
}

#[test]
fn viterbi_equals_brute_force_over_all_legal_paths() {
    // O plus two entities, in a shuffled class order
    let names = ["O", "S-b", "B-a", "E-b", "I-a", "B-b", "E-a", "S-a", "I-b"];
    let labels: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let tags = TagSet::from_id2label(&labels.iter().cloned().enumerate().collect::<Vec<_>>()).unwrap();
    let n = labels.len();
    let mut rng = Rng(0x9E3779B97F4A7C15);
    let mut cases = 0;
    for t_len in 1..=5 {
        for _ in 0..if t_len <= 3 { 40 } else { 6 } {
            // log-softmax rows of random logits
            let mut em = Vec::with_capacity(t_len * n);
            for _ in 0..t_len {
                let row: Vec<f32> = (0..n).map(|_| rng.range(-4.0, 4.0)).collect();
                let lse = row.iter().map(|x| x.exp()).sum::<f32>().ln();
                em.extend(row.iter().map(|x| x - lse));
            }
            let w: [f32; 6] = std::array::from_fn(|_| rng.range(-3.0, 3.0));
            let cal = Calibration {
                background_stay: w[0],
                background_to_start: w[1],
                end_to_background: w[2],
                end_to_start: w[3],
                inside_to_continue: w[4],
                inside_to_end: w[5],
            };
            let got = viterbi(&em, n, &tags, &cal).unwrap();
            let (want, best) = brute_force(&labels, &em, t_len, &w);
            let first = labels[got[0]].chars().next().unwrap();
            let last = labels[got[t_len - 1]].chars().next().unwrap();
            assert!(matches!(first, 'O' | 'B' | 'S') && matches!(last, 'O' | 'E' | 'S'), "{got:?}");
            let s = score_of(&labels, &em, &got, &w);
            assert!((s - best).abs() < 1e-4, "T={t_len}: decoder score {s} vs best {best}");
            assert_eq!(got, want, "T={t_len}");
            // spans: every entity tag of the path is in exactly one span, labels consistent
            let sp = spans(&got, &tags);
            let covered: usize = sp.iter().map(|s| s.end - s.start).sum();
            assert_eq!(covered, got.iter().filter(|&&c| labels[c] != "O").count());
            for s in &sp {
                for t in s.start..s.end {
                    assert!(labels[got[t]].ends_with(&format!("-{}", tags.entities[s.entity])));
                }
            }
            cases += 1;
        }
    }
    assert_eq!(cases, 3 * 40 + 2 * 6);
    assert!(viterbi(&[], n, &tags, &Calibration::default()).unwrap().is_empty());
    assert!(matches!(viterbi(&[0.0; 5], n, &tags, &Calibration::default()), Err(PrivacyError::Decode(_))));
}

#[test]
fn spans_of_known_paths() {
    let labels: Vec<String> = ["O", "B-x", "I-x", "E-x", "S-x", "B-y", "I-y", "E-y", "S-y"].iter().map(|s| s.to_string()).collect();
    let tags = TagSet::from_id2label(&labels.iter().cloned().enumerate().collect::<Vec<_>>()).unwrap();
    let id = |l: &str| labels.iter().position(|x| x == l).unwrap();
    let path: Vec<usize> = ["S-x", "O", "B-y", "I-y", "I-y", "E-y", "S-y", "B-x", "E-x", "O"].iter().map(|l| id(l)).collect();
    let got: Vec<(String, usize, usize)> = spans(&path, &tags).into_iter().map(|s| (tags.entities[s.entity].clone(), s.start, s.end)).collect();
    assert_eq!(got, vec![("x".into(), 0, 1), ("y".into(), 2, 6), ("y".into(), 6, 7), ("x".into(), 7, 9)]);
}

#[test]
fn tag_sets_reject_bad_labels() {
    let ok = |v: &[&str]| TagSet::from_id2label(&v.iter().map(|s| s.to_string()).enumerate().collect::<Vec<_>>());
    assert!(ok(&["O", "B-a", "I-a", "E-a", "S-a"]).is_ok());
    for bad in [
        &["B-a", "I-a", "E-a", "S-a"][..],           // no O
        &["O", "O", "B-a", "I-a", "E-a", "S-a"],      // two O
        &["O", "B-a", "I-a", "S-a"],                  // no E-a
        &["O", "B-a", "I-a", "E-a", "S-a", "S-a"],    // duplicate
        &["O", "B-a", "I-a", "E-a", "Z-a"],           // bad prefix
        &["O", "B-", "I-", "E-", "S-"],               // empty name
        &["O", "Ba", "Ia", "Ea", "Sa"],               // no dash
        &[],
    ] {
        assert!(matches!(ok(bad), Err(PrivacyError::Labels(_))), "{bad:?}");
    }
    let sparse = vec![(0, "O".to_string()), (2, "S-a".to_string())];
    assert!(matches!(TagSet::from_id2label(&sparse), Err(PrivacyError::Labels(_))));
}
