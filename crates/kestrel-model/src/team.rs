//! A CPU forward's threads, kept awake between its parallel loops.
//!
//! A SmolLM2 decode step on the CPU is ~200 parallel loops (a matvec per projection, an
//! attention per layer) a few tens of µs apart. Through rayon alone the idle worker falls
//! asleep between two loops, and the next loop pays a futex wake and a context switch, by
//! which time the caller has done most of the work alone: on 2 cores the second thread made
//! a bf16 decode step only 1.17× faster than one thread. [`run`] spans one forward: its
//! helpers (jobs on rayon's other workers) spin between loops, running rayon's other jobs
//! while they wait, and every loop of the forward ([`for_each_chunk_mut`]) shares its tasks
//! with them through an atomic counter.
//!
//! Results never depend on it: a loop's tasks write disjoint outputs, each task runs exactly
//! once, and which thread runs it changes no arithmetic. Outside a team (other threads, or a
//! loop inside a task) loops fall back to rayon.

use rayon::prelude::*;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock};
use std::thread::ThreadId;

thread_local! {
    /// The team whose forward runs on this thread, while no loop of it is open.
    static CURRENT: Cell<Option<*const Team>> = const { Cell::new(None) };
}

/// The loop the team is running: tasks `0..n` of `task`, handed out by `next`.
struct Job {
    /// Lifetime-erased; valid while the job's epoch is open (see [`Team::share`]).
    task: *const (dyn Fn(usize) + Sync),
    n: usize,
}

struct Team {
    /// The thread running the forward (set once the scope runs).
    owner: OnceLock<ThreadId>,
    /// Odd while a job is open; helpers join a job only while its epoch holds.
    epoch: AtomicUsize,
    /// Helpers inside the current job: the owner closes a job and waits for zero before
    /// its task goes out of scope.
    inside: AtomicUsize,
    next: AtomicUsize,
    finished: AtomicUsize,
    job: Mutex<Option<Job>>,
    /// A task panicked on a helper: the owner re-raises it.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    stop: AtomicBool,
}

// SAFETY: `Job::task` points at a `Sync` closure that the owner keeps alive while any helper
// can reach it (the epoch protocol in `share`); everything else is atomics and mutexes.
unsafe impl Sync for Team {}
unsafe impl Send for Job {}

/// Steps of more rows than this (prompts) keep rayon's own scheduling: their loops are long
/// enough that a wake-up is noise, and candle's GEMM, which long prompts take, ran 5-13%
/// slower with helpers spinning beside it.
const MAX_ROWS: usize = 64;

/// Runs `f`, a forward over `rows` rows, on rayon's pool (one hop, so that its parallel
/// loops join on worker threads), with the other workers as its spinning helpers unless
/// the step is a prompt's.
pub(crate) fn run<R: Send>(rows: usize, f: impl FnOnce() -> R + Send) -> R {
    let helpers = rayon::current_num_threads().saturating_sub(1);
    if rows > MAX_ROWS {
        return rayon::scope(|_| f());
    }
    if helpers == 0 || CURRENT.with(|c| c.get()).is_some() {
        return f();
    }
    let team = Team {
        owner: OnceLock::new(),
        epoch: AtomicUsize::new(0),
        inside: AtomicUsize::new(0),
        next: AtomicUsize::new(0),
        finished: AtomicUsize::new(0),
        job: Mutex::new(None),
        panic: Mutex::new(None),
        stop: AtomicBool::new(false),
    };
    let team = &team;
    rayon::scope(move |scope| {
        // The scope runs this on a worker thread, not necessarily the caller's.
        let _ = team.owner.set(std::thread::current().id());
        for _ in 0..helpers {
            scope.spawn(move |_| team.help());
        }
        // Stops the helpers however `f` ends, so the scope's join cannot hang.
        struct Stop<'a>(&'a Team);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.stop.store(true, SeqCst);
                CURRENT.with(|c| c.set(None));
            }
        }
        let _stop = Stop(team);
        CURRENT.with(|c| c.set(Some(team as *const Team)));
        f()
    })
}

/// Calls `task(i, chunk)` for each `chunk`-long piece of `out` (the last may be shorter),
/// on the current team's threads if this thread runs one, else on rayon's pool.
pub(crate) fn for_each_chunk_mut<T: Send>(
    out: &mut [T],
    chunk: usize,
    task: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk = chunk.max(1);
    let n = out.len().div_ceil(chunk);
    let len = out.len();
    let base = SendPtr(out.as_mut_ptr());
    for_each_task(n, |i| {
        let start = i * chunk;
        let end = (start + chunk).min(len);
        // SAFETY: each i in 0..n runs exactly once, so the pieces are disjoint, and all lie
        // within `out`, which is mutably borrowed until every task has finished.
        let piece = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
        task(i, piece);
    });
}

/// Calls `task(i)` once for each `i` in `0..n`, on the current team's threads if this
/// thread runs one, else on rayon's pool; returns when all have run.
pub(crate) fn for_each_task(n: usize, task: impl Fn(usize) + Sync) {
    let team = CURRENT.with(|c| c.get());
    let Some(team) = team.filter(|_| n > 1) else {
        (0..n).into_par_iter().for_each(&task);
        return;
    };
    // SAFETY: `team` was set by `run` on this thread and lives until `run` returns, which
    // cannot happen while this call is on the stack.
    unsafe { &*team }.share(n, &task);
}

/// One idle turn of a wait loop that has already waited `idle` turns; returns the count.
/// Spins first (a loop's next task is usually microseconds away), then gives the core up
/// each turn: with more runnable threads than cores (two processes on two cores), a spinning
/// waiter would otherwise hold the core the thread it waits for needs (measured: a decode
/// step 1.6× slower than rayon alone until waits yielded).
fn pause(idle: u32) -> u32 {
    if idle < SPINS_BEFORE_YIELD {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
    idle.saturating_add(1)
}

/// Spins a waiter takes before it starts yielding its core.
const SPINS_BEFORE_YIELD: u32 = 64;

struct SendPtr<T>(*mut T);
// By hand: derived impls would ask for `T: Copy`.
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: only used to rebuild disjoint sub-slices (see `for_each_chunk_mut`).
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

impl Team {
    /// Runs tasks `0..n` on the owner and every helper that joins, and returns once all are
    /// done. Called only by the owner, never from inside one of its own tasks.
    fn share(&self, n: usize, task: &(dyn Fn(usize) + Sync)) {
        // A loop inside one of this job's tasks falls back to rayon (the slot is taken).
        CURRENT.with(|c| c.set(None));
        // SAFETY (lifetime erasure): helpers call `task` only between the epoch's opening
        // and the owner's wait for `inside == 0` below, both before this function returns.
        let erased: *const (dyn Fn(usize) + Sync) = unsafe {
            std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(
                task,
            )
        };
        *self.job.lock().expect("team job") = Some(Job { task: erased, n });
        self.next.store(0, SeqCst);
        self.finished.store(0, SeqCst);
        self.epoch.fetch_add(1, SeqCst); // open
        let mine = catch_unwind(AssertUnwindSafe(|| self.work(task, n)));
        let mut idle = 0u32;
        while self.finished.load(SeqCst) < n {
            idle = pause(idle);
        }
        self.epoch.fetch_add(1, SeqCst); // closed: no helper joins from here on
        while self.inside.load(SeqCst) != 0 {
            idle = pause(idle);
        }
        *self.job.lock().expect("team job") = None;
        CURRENT.with(|c| c.set(Some(self as *const Team)));
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if let Some(p) = self.panic.lock().expect("team panic").take() {
            resume_unwind(p);
        }
    }

    /// Takes tasks until none are left; a panicking task still counts as finished, so the
    /// owner's wait ends, and its panic goes to the owner.
    fn work(&self, task: &(dyn Fn(usize) + Sync), n: usize) {
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= n {
                return;
            }
            let r = catch_unwind(AssertUnwindSafe(|| task(i)));
            self.finished.fetch_add(1, SeqCst);
            if let Err(p) = r {
                self.panic.lock().expect("team panic").get_or_insert(p);
            }
        }
    }

    /// A helper's loop: join each open job, and between jobs run rayon's pending work or
    /// spin, until the forward ends.
    fn help(&self) {
        // A helper job the owner itself picked up (while waiting inside rayon) must not spin:
        // the forward it waits for would never end.
        if self.owner.get() == Some(&std::thread::current().id()) {
            return;
        }
        let mut done_epoch = 0;
        let mut idle = 0u32;
        while !self.stop.load(SeqCst) {
            let e = self.epoch.load(SeqCst);
            if e % 2 == 1 && e != done_epoch {
                self.inside.fetch_add(1, SeqCst);
                // Re-checked after registering: if the job closed in between, the owner may
                // already have stopped waiting, so its task must not be touched.
                if self.epoch.load(SeqCst) == e {
                    let job = self
                        .job
                        .lock()
                        .expect("team job")
                        .as_ref()
                        .map(|j| (j.task, j.n));
                    if let Some((task, n)) = job {
                        // SAFETY: the epoch is open and this helper is counted in `inside`,
                        // so the owner is still inside `share`, which keeps `task` alive.
                        self.work(unsafe { &*task }, n);
                    }
                }
                self.inside.fetch_sub(1, SeqCst);
                done_epoch = e;
                idle = 0;
            } else if rayon::yield_now() != Some(rayon::Yield::Executed) {
                idle = pause(idle);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool")
    }

    #[test]
    fn every_chunk_runs_once_inside_a_team_and_outside() {
        let pool = pool(3);
        pool.install(|| {
            for inside in [true, false] {
                let counts: Vec<AtomicU32> = (0..1000).map(|_| AtomicU32::new(0)).collect();
                let body = || {
                    for round in 0..50usize {
                        let mut out = vec![0usize; 1000];
                        for_each_chunk_mut(&mut out, 7, |i, c| {
                            for (j, v) in c.iter_mut().enumerate() {
                                *v = i * 7 + j + round;
                                counts[i * 7 + j].fetch_add(1, SeqCst);
                            }
                        });
                        assert!(out.iter().enumerate().all(|(j, &v)| v == j + round));
                    }
                };
                if inside {
                    run(1, body);
                } else {
                    body();
                }
                assert!(counts.iter().all(|c| c.load(SeqCst) == 50));
            }
        });
    }

    #[test]
    fn a_loop_inside_a_task_runs_and_the_team_survives_it() {
        let pool = pool(2);
        let total = pool.install(|| {
            run(1, || {
                let mut outer = vec![0u64; 8];
                for_each_chunk_mut(&mut outer, 1, |i, c| {
                    let mut inner = vec![0u64; 16];
                    for_each_chunk_mut(&mut inner, 4, |j, d| d.fill((i * 10 + j) as u64));
                    c[0] = inner.iter().sum();
                });
                let mut after = vec![0u64; 4];
                for_each_chunk_mut(&mut after, 1, |i, c| c[0] = i as u64);
                outer.iter().sum::<u64>() + after.iter().sum::<u64>()
            })
        });
        // Σ_i Σ_j 4·(10i + j) over i < 8, j < 4, plus 0 + 1 + 2 + 3.
        assert_eq!(total, 4 * (10 * 28 * 4 + 6 * 8) + 6);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller() {
        let pool = pool(2);
        let r = pool.install(|| {
            catch_unwind(AssertUnwindSafe(|| {
                run(1, || {
                    let mut out = vec![0u8; 64];
                    for_each_chunk_mut(&mut out, 1, |i, _| assert!(i != 40, "task 40"));
                })
            }))
        });
        let msg = r.expect_err("the panic propagates");
        assert_eq!(msg.downcast_ref::<&str>(), Some(&"task 40"));
    }
}
