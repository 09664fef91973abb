//! Threads that repeat a step until their owner is dropped: the servers and observers of the
//! test bed and the benchmark.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

#[derive(Default)]
pub struct Workers {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    /// Runs `step` over and over on a new thread. Steps should block briefly (a socket timeout,
    /// a short sleep), so that dropping the workers stops them promptly.
    pub fn spawn(&mut self, mut step: impl FnMut() + Send + 'static) {
        let stop = self.stop.clone();
        self.threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                step();
            }
        }));
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}
