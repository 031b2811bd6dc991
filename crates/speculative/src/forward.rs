//! [`forward_drafter!`]: wrappers of a [`crate::Drafter`] that pass on every call they do not
//! intercept.

/// Implements every [`Drafter`](crate::Drafter) method of a wrapper but those listed after
/// `except` by passing the call on to the drafter in field `$field` (a field name or a tuple
/// index; of any type implementing `Drafter`, `Box<dyn Drafter>` included). Write the listed
/// ones next to it in the same `impl` block:
///
/// ```
/// use mlx_speculative::{forward_drafter, Draft, Drafter};
/// # use mlx_models::{Cache, Result};
/// # use sampling::SamplingConfig;
/// /// Counts proposals and passes everything on.
/// struct Counting {
///     inner: Box<dyn Drafter>,
///     proposals: usize,
/// }
///
/// impl Drafter for Counting {
///     forward_drafter!(inner; except propose, propose_on);
///     fn propose(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig) -> Result<Draft> {
///         self.proposals += 1;
///         self.inner.propose(history, k, sampling)
///     }
///     fn propose_on(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig, target: &mut Cache) -> Result<Draft> {
///         self.proposals += 1;
///         self.inner.propose_on(history, k, sampling, target)
///     }
/// }
/// ```
///
/// A wrapper that intercepts `propose` must intercept `propose_on` too (the decoder proposes
/// through `propose_on`; the macro refuses to pass that on alone).
///
/// Either check fails the build:
///
/// ```compile_fail
/// use mlx_speculative::{forward_drafter, Drafter};
/// struct Misspelt(Box<dyn Drafter>);
/// impl Drafter for Misspelt {
///     forward_drafter!(0; except propse); // no such method
/// }
/// ```
///
/// ```compile_fail
/// use mlx_speculative::{forward_drafter, Draft, Drafter};
/// # use mlx_models::Result;
/// # use sampling::SamplingConfig;
/// struct Half(Box<dyn Drafter>);
/// impl Drafter for Half {
///     forward_drafter!(0; except propose); // propose_on would bypass it
///     fn propose(&mut self, history: &[u32], k: usize, sampling: &SamplingConfig) -> Result<Draft> {
///         self.0.propose(history, k, sampling)
///     }
/// }
/// ```
///
/// A drafter shared behind a lock (`Mutex<D>` or `Arc<Mutex<D>>` in `$field`) is passed each
/// call under the lock with `lock $field`. `target_taps` answers with a borrow the lock's guard
/// cannot hand out, so it must be listed and written by hand (the macro refuses otherwise):
///
/// ```
/// use mlx_speculative::{forward_drafter, DraftModel, Drafter};
/// use std::sync::{Arc, Mutex};
/// /// One draft model for several decoders, one at a time.
/// struct Shared(Arc<Mutex<DraftModel>>);
///
/// impl Drafter for Shared {
///     forward_drafter!(lock 0; except target_taps);
///     fn target_taps(&self) -> &[usize] {
///         &[] // a draft model reads none of the target's layers
///     }
/// }
/// ```
///
/// A lock poisoned by a panic is taken over as it is (`PoisonError::into_inner`).
///
/// ```compile_fail
/// use mlx_speculative::{forward_drafter, DraftModel, Drafter};
/// use std::sync::Mutex;
/// struct Open(Mutex<DraftModel>);
/// impl Drafter for Open {
///     forward_drafter!(lock 0); // target_taps cannot be passed on
/// }
/// ```
///
/// A wrapper written by hand takes the trait's default for any method it leaves out, which
/// silently switches that behaviour off (a drafter's agreement, its drafting ahead); with the
/// macro a method added to the trait is passed on as well.
#[macro_export]
macro_rules! forward_drafter {
    ($field:tt) => {
        $crate::__forward_drafter!([] (field $field));
    };
    (lock $field:tt; except $($skip:ident),* $(,)?) => {
        $crate::__drafter_if_listed!(target_taps [$($skip)*] {} {
            compile_error!("forward_drafter!(lock ..): `target_taps` answers with a borrow that cannot outlive the lock: list it after `except` and write it by hand");
        });
        $crate::__forward_drafter_checked!([$($skip)*] (lock $field));
    };
    (lock $field:tt) => {
        compile_error!("forward_drafter!(lock ..): `target_taps` answers with a borrow that cannot outlive the lock: list it after `except` and write it by hand");
    };
    ($field:tt; except $($skip:ident),* $(,)?) => {
        $crate::__forward_drafter_checked!([$($skip)*] (field $field));
    };
}

/// [`forward_drafter!`]'s `except` list checked (every name a method; `propose` intercepted
/// only with `propose_on`), then its body.
#[doc(hidden)]
#[macro_export]
macro_rules! __forward_drafter_checked {
    ([$($skip:ident)*] $to:tt) => {
        $($crate::__drafter_method_is!($skip $skip {} {
            compile_error!(concat!("forward_drafter!: `", stringify!($skip), "` is no Drafter method"));
        });)*
        // the trait's `propose_on` calls `propose`: passing it on while intercepting `propose`
        // would let the decoder's proposals (`propose_on`) bypass the interception
        $crate::__drafter_if_listed!(propose [$($skip)*] {
            $crate::__drafter_if_listed!(propose_on [$($skip)*] {} {
                compile_error!("forward_drafter!: a wrapper intercepting `propose` intercepts `propose_on` too");
            });
        } {});
        $crate::__forward_drafter!([$($skip)*] $to);
    };
}

/// [`forward_drafter!`]'s body: every method not in the list passed on to the drafter that
/// `$to` names in [`__drafter_inner!`]'s terms.
#[doc(hidden)]
#[macro_export]
macro_rules! __forward_drafter {
    ([$($skip:ident)*] $to:tt) => {
        $crate::__forward_drafter_unless!(propose [$($skip)*] {
            fn propose(&mut self, history: &[u32], k: usize, sampling: &$crate::__macro_support::SamplingConfig) -> $crate::__macro_support::Result<$crate::Draft> {
                $crate::Drafter::propose($crate::__drafter_inner!(mut self $to), history, k, sampling)
            }
        });
        $crate::__forward_drafter_unless!(propose_on [$($skip)*] {
            fn propose_on(&mut self, history: &[u32], k: usize, sampling: &$crate::__macro_support::SamplingConfig, target_cache: &mut $crate::__macro_support::Cache) -> $crate::__macro_support::Result<$crate::Draft> {
                $crate::Drafter::propose_on($crate::__drafter_inner!(mut self $to), history, k, sampling, target_cache)
            }
        });
        $crate::__forward_drafter_unless!(target_positions_run [$($skip)*] {
            fn target_positions_run(&self) -> usize {
                $crate::Drafter::target_positions_run($crate::__drafter_inner!(ref self $to))
            }
        });
        $crate::__forward_drafter_unless!(draft_ahead [$($skip)*] {
            fn draft_ahead(&mut self, history: &[u32], drafts: &[u32], steps: usize, until: Option<&dyn Fn() -> bool>) -> $crate::__macro_support::Result<()> {
                $crate::Drafter::draft_ahead($crate::__drafter_inner!(mut self $to), history, drafts, steps, until)
            }
        });
        $crate::__forward_drafter_unless!(runs_ahead [$($skip)*] {
            fn runs_ahead(&self) -> bool {
                $crate::Drafter::runs_ahead($crate::__drafter_inner!(ref self $to))
            }
        });
        $crate::__forward_drafter_unless!(skipped [$($skip)*] {
            fn skipped(&mut self, history: &[u32], window: usize) {
                $crate::Drafter::skipped($crate::__drafter_inner!(mut self $to), history, window)
            }
        });
        $crate::__forward_drafter_unless!(catch_up [$($skip)*] {
            fn catch_up(&mut self, history: &[u32], window: usize, sampling: &$crate::__macro_support::SamplingConfig) -> $crate::__macro_support::Result<()> {
                $crate::Drafter::catch_up($crate::__drafter_inner!(mut self $to), history, window, sampling)
            }
        });
        $crate::__forward_drafter_unless!(measures_agreement [$($skip)*] {
            fn measures_agreement(&self) -> bool {
                $crate::Drafter::measures_agreement($crate::__drafter_inner!(ref self $to))
            }
        });
        $crate::__forward_drafter_unless!(agreement [$($skip)*] {
            fn agreement(&mut self) -> $crate::__macro_support::Result<Vec<$crate::Agreed>> {
                $crate::Drafter::agreement($crate::__drafter_inner!(mut self $to))
            }
        });
        $crate::__forward_drafter_unless!(reserve [$($skip)*] {
            fn reserve(&mut self, positions: usize) {
                $crate::Drafter::reserve($crate::__drafter_inner!(mut self $to), positions)
            }
        });
        $crate::__forward_drafter_unless!(prefill [$($skip)*] {
            fn prefill(&mut self, history: &[u32]) -> $crate::__macro_support::Result<()> {
                $crate::Drafter::prefill($crate::__drafter_inner!(mut self $to), history)
            }
        });
        $crate::__forward_drafter_unless!(settle [$($skip)*] {
            fn settle(&mut self) -> $crate::__macro_support::Result<()> {
                $crate::Drafter::settle($crate::__drafter_inner!(mut self $to))
            }
        });
        $crate::__forward_drafter_unless!(feedback [$($skip)*] {
            fn feedback(&mut self, f: &$crate::Feedback<'_>) -> $crate::__macro_support::Result<()> {
                $crate::Drafter::feedback($crate::__drafter_inner!(mut self $to), f)
            }
        });
        $crate::__forward_drafter_unless!(wants_target_hidden [$($skip)*] {
            fn wants_target_hidden(&self) -> bool {
                $crate::Drafter::wants_target_hidden($crate::__drafter_inner!(ref self $to))
            }
        });
        $crate::__forward_drafter_unless!(target_taps [$($skip)*] {
            fn target_taps(&self) -> &[usize] {
                $crate::Drafter::target_taps($crate::__drafter_inner!(ref self $to))
            }
        });
        $crate::__forward_drafter_unless!(weight_bytes [$($skip)*] {
            fn weight_bytes(&self) -> Option<u64> {
                $crate::Drafter::weight_bytes($crate::__drafter_inner!(ref self $to))
            }
        });
        $crate::__forward_drafter_unless!(vocab_size [$($skip)*] {
            fn vocab_size(&self) -> usize {
                $crate::Drafter::vocab_size($crate::__drafter_inner!(ref self $to))
            }
        });
        $crate::__forward_drafter_unless!(default_depth [$($skip)*] {
            fn default_depth(&self) -> usize {
                $crate::Drafter::default_depth($crate::__drafter_inner!(ref self $to))
            }
        });
        $crate::__forward_drafter_unless!(max_depth [$($skip)*] {
            fn max_depth(&self) -> Option<usize> {
                $crate::Drafter::max_depth($crate::__drafter_inner!(ref self $to))
            }
        });
    };
}

/// [`forward_drafter!`]'s helper: the drafter calls are passed to, `(field F)` (`self.F`),
/// `(lock F)` (what `self.F.lock()` guards, for the length of the call) or `(deref)` (`**self`,
/// for a box).
#[doc(hidden)]
#[macro_export]
macro_rules! __drafter_inner {
    (mut $s:ident (lock $f:tt)) => {
        &mut *$s.$f.lock().unwrap_or_else(::std::sync::PoisonError::into_inner)
    };
    (ref $s:ident (lock $f:tt)) => {
        &*$s.$f.lock().unwrap_or_else(::std::sync::PoisonError::into_inner)
    };
    (mut $s:ident (field $f:tt)) => {
        &mut $s.$f
    };
    (ref $s:ident (field $f:tt)) => {
        &$s.$f
    };
    (mut $s:ident (deref)) => {
        &mut **$s
    };
    (ref $s:ident (deref)) => {
        &**$s
    };
}

/// [`forward_drafter!`]'s helper: the method item unless its name is in the list.
#[doc(hidden)]
#[macro_export]
macro_rules! __forward_drafter_unless {
    ($name:ident [$($list:ident)*] {$($item:tt)*}) => {
        $crate::__drafter_if_listed!($name [$($list)*] {} {$($item)*});
    };
}

/// [`forward_drafter!`]'s helper: the first block when the name is in the list, else the
/// second.
#[doc(hidden)]
#[macro_export]
macro_rules! __drafter_if_listed {
    ($name:ident [] {$($y:tt)*} {$($n:tt)*}) => {
        $($n)*
    };
    ($name:ident [$first:ident $($rest:ident)*] {$($y:tt)*} {$($n:tt)*}) => {
        $crate::__drafter_method_is!($name $first {$($y)*} {
            $crate::__drafter_if_listed!($name [$($rest)*] {$($y)*} {$($n)*});
        });
    };
}

/// [`forward_drafter!`]'s helper: the first block when the two names are the same
/// [`Drafter`](crate::Drafter) method, else the second.
#[doc(hidden)]
#[macro_export]
macro_rules! __drafter_method_is {
    (propose propose {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (propose_on propose_on {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (target_positions_run target_positions_run {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (draft_ahead draft_ahead {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (runs_ahead runs_ahead {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (skipped skipped {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (catch_up catch_up {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (measures_agreement measures_agreement {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (agreement agreement {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (reserve reserve {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (prefill prefill {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (settle settle {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (feedback feedback {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (wants_target_hidden wants_target_hidden {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (target_taps target_taps {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (weight_bytes weight_bytes {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (vocab_size vocab_size {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (default_depth default_depth {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    (max_depth max_depth {$($y:tt)*} {$($n:tt)*}) => { $($y)* };
    ($a:ident $b:ident {$($y:tt)*} {$($n:tt)*}) => { $($n)* };
}

/// A boxed drafter drafts as the drafter in it (`Box<dyn Drafter>` included).
impl<D: crate::Drafter + ?Sized> crate::Drafter for Box<D> {
    crate::__forward_drafter!([] (deref));
}

#[cfg(test)]
pub(crate) mod probe {
    use crate::{Agreed, Draft, Drafter, Feedback};
    use mlx_models::{Cache, CacheSpec, Result};
    use sampling::SamplingConfig;
    use std::sync::{Arc, Mutex};

    /// A drafter answering every call as no trait default does, noting each call (with
    /// `reads_target`, one that reads the target's states; without, one that may move to a
    /// thread of its own).
    pub(crate) struct Probe {
        pub(crate) calls: Arc<Mutex<Vec<&'static str>>>,
        pub(crate) reads_target: bool,
    }

    impl Probe {
        fn note(&self, call: &'static str) {
            self.calls.lock().unwrap().push(call);
        }
    }

    impl Drafter for Probe {
        fn propose(&mut self, _: &[u32], k: usize, _: &SamplingConfig) -> Result<Draft> {
            self.note("propose");
            Ok(Draft { tokens: vec![5; k], logprobs: None })
        }
        fn propose_on(&mut self, _: &[u32], k: usize, _: &SamplingConfig, _: &mut Cache) -> Result<Draft> {
            self.note("propose_on");
            Ok(Draft { tokens: vec![6; k], logprobs: None })
        }
        fn target_positions_run(&self) -> usize {
            self.note("target_positions_run");
            9
        }
        fn draft_ahead(&mut self, _: &[u32], _: &[u32], _: usize, _: Option<&dyn Fn() -> bool>) -> Result<()> {
            self.note("draft_ahead");
            Ok(())
        }
        fn runs_ahead(&self) -> bool {
            self.note("runs_ahead");
            true
        }
        fn skipped(&mut self, _: &[u32], _: usize) {
            self.note("skipped");
        }
        fn catch_up(&mut self, _: &[u32], _: usize, _: &SamplingConfig) -> Result<()> {
            self.note("catch_up");
            Ok(())
        }
        fn measures_agreement(&self) -> bool {
            self.note("measures_agreement");
            true
        }
        fn agreement(&mut self) -> Result<Vec<Agreed>> {
            self.note("agreement");
            Ok(vec![Agreed { position: 1, guessed: true, logprob: None }, Agreed { position: 2, guessed: false, logprob: Some(-0.5) }])
        }
        fn reserve(&mut self, _: usize) {
            self.note("reserve");
        }
        fn prefill(&mut self, _: &[u32]) -> Result<()> {
            self.note("prefill");
            Ok(())
        }
        fn settle(&mut self) -> Result<()> {
            self.note("settle");
            Ok(())
        }
        fn feedback(&mut self, _: &Feedback<'_>) -> Result<()> {
            self.note("feedback");
            Ok(())
        }
        fn wants_target_hidden(&self) -> bool {
            self.note("wants_target_hidden");
            self.reads_target
        }
        fn target_taps(&self) -> &[usize] {
            self.note("target_taps");
            if self.reads_target {
                &[1, 2]
            } else {
                &[]
            }
        }
        fn weight_bytes(&self) -> Option<u64> {
            self.note("weight_bytes");
            Some(7)
        }
        fn vocab_size(&self) -> usize {
            self.note("vocab_size");
            11
        }
        fn default_depth(&self) -> usize {
            self.note("default_depth");
            3
        }
        fn max_depth(&self) -> Option<usize> {
            self.note("max_depth");
            Some(5)
        }
    }

    /// Every method of `d`, each answer checked against a [`Probe`]'s (`reads_target` as
    /// the probe's; `propose_on` answering as the probe's `propose` with `plain_propose_on`)
    /// but `vocab_size`'s, which is returned.
    pub(crate) fn call_everything(d: &mut dyn Drafter, reads_target: bool, plain_propose_on: bool) -> usize {
        let greedy = SamplingConfig::greedy();
        assert_eq!(d.propose(&[1], 2, &greedy).unwrap().tokens, [5, 5]);
        let mut cache = Cache::new(&CacheSpec { layers: Vec::new() });
        let on = if plain_propose_on { 5 } else { 6 };
        assert_eq!(d.propose_on(&[1], 2, &greedy, &mut cache).unwrap().tokens, [on, on]);
        assert_eq!(d.target_positions_run(), 9);
        d.draft_ahead(&[1], &[5, 5], 2, None).unwrap();
        assert!(d.runs_ahead());
        d.skipped(&[1, 2], 4);
        d.catch_up(&[1, 2], 4, &greedy).unwrap();
        assert!(d.measures_agreement());
        let agreed = d.agreement().unwrap();
        assert_eq!(agreed.iter().map(|a| (a.position, a.guessed, a.logprob)).collect::<Vec<_>>(), [(1, true, None), (2, false, Some(-0.5))]);
        d.reserve(64);
        d.prefill(&[1]).unwrap();
        d.settle().unwrap();
        d.feedback(&Feedback { history: &[1], drafts: &[5, 5], accepted: 1, next: 4, hidden: None, taps: &[] }).unwrap();
        assert_eq!(d.wants_target_hidden(), reads_target);
        assert_eq!(d.target_taps(), if reads_target { &[1, 2][..] } else { &[] });
        assert_eq!(d.weight_bytes(), Some(7));
        assert_eq!(d.default_depth(), 3);
        assert_eq!(d.max_depth(), Some(5));
        d.vocab_size()
    }
}


#[cfg(test)]
mod tests {
    use super::probe::{call_everything, Probe};
    use crate::Drafter;
    use std::sync::{Arc, Mutex};

    const EVERY_CALL: [&str; 19] = [
        "propose", "propose_on", "target_positions_run", "draft_ahead", "runs_ahead", "skipped", "catch_up",
        "measures_agreement", "agreement", "reserve", "prefill", "settle", "feedback", "wants_target_hidden",
        "target_taps", "weight_bytes", "default_depth", "max_depth", "vocab_size",
    ];

    struct Named {
        inner: Probe,
    }

    impl Drafter for Named {
        forward_drafter!(inner);
    }

    struct Boxed(Box<dyn Drafter>);

    impl Drafter for Boxed {
        forward_drafter!(0; except vocab_size);
        fn vocab_size(&self) -> usize {
            99
        }
    }

    struct Locked(Arc<Mutex<Probe>>);

    impl Drafter for Locked {
        forward_drafter!(lock 0; except target_taps);
        fn target_taps(&self) -> &[usize] {
            &[]
        }
    }

    /// `forward_drafter!(lock ..)` passes every call but `target_taps` on under the lock, and
    /// takes over a lock a panic poisoned.
    #[test]
    fn a_locked_drafter_is_passed_every_call_but_target_taps() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::new(Mutex::new(Probe { calls: calls.clone(), reads_target: false }));
        let mut locked = Locked(shared.clone());
        assert_eq!(call_everything(&mut locked, false, false), 11);
        let every: Vec<&str> = EVERY_CALL.iter().copied().filter(|&c| c != "target_taps").collect();
        assert_eq!(std::mem::take(&mut *calls.lock().unwrap()), every);

        let poisoner = shared.clone();
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock().unwrap();
            panic!("poisons the lock");
        })
        .join();
        assert!(shared.is_poisoned());
        assert_eq!(locked.vocab_size(), 11);
        assert_eq!(std::mem::take(&mut *calls.lock().unwrap()), ["vocab_size"]);
    }

    /// `forward_drafter!` passes every call on, from a named field or a boxed one in a tuple
    /// field, but those it is told to leave to the wrapper; a box drafts as what it holds.
    #[test]
    fn every_call_is_passed_on_but_those_excepted() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let mut named = Named { inner: Probe { calls: calls.clone(), reads_target: true } };
        assert_eq!(call_everything(&mut named, true, false), 11);
        assert_eq!(std::mem::take(&mut *calls.lock().unwrap()), EVERY_CALL);

        let mut boxed = Boxed(Box::new(Probe { calls: calls.clone(), reads_target: true }));
        assert_eq!(call_everything(&mut boxed, true, false), 99);
        assert_eq!(std::mem::take(&mut *calls.lock().unwrap()), EVERY_CALL[..18]);

        let mut in_a_box: Box<dyn Drafter> = Box::new(Named { inner: Probe { calls: calls.clone(), reads_target: true } });
        assert_eq!(call_everything(&mut in_a_box, true, false), 11);
        assert_eq!(std::mem::take(&mut *calls.lock().unwrap()), EVERY_CALL);
    }
}
