//! Where a Raft write's outcome arrives for the thread that waits for it:
//! a shard's Raft group's responder (a leaf: it knows openraft's responder
//! trait and nothing of the store).

use openraft::OptionalSend;
use std::sync::{Arc, Mutex};

/// Where a proposal's outcome arrives for the thread that waits for it
/// (the shard's writer, or a caller committing on its own thread): the
/// group's responder, so the answer goes from openraft's apply straight to
/// the waiting thread, with no task in between.
pub struct WriteSlot<T> {
    slot: Arc<Slot<T>>,
    answered: bool,
}

struct Slot<T> {
    state: Mutex<Answer<T>>,
    filled: std::sync::Condvar,
    /// Unparked when the answer arrives: a writer with groups in flight
    /// parks until either an answer or a new command comes.
    waker: Option<std::thread::Thread>,
}

/// What a [`WriteSlot`] came to.
pub(crate) enum Answer<T> {
    Waiting,
    Done(T),
    /// The group let go of the proposal without answering (it stopped).
    Dropped,
    /// The writer stopped waiting, for this reason (its leader seems cut
    /// off); the entry may still be committed.
    Abandoned(String),
}

impl<T> WriteSlot<T> {
    /// A slot, and the wait on it; `waker` is unparked when the answer
    /// arrives.
    pub(crate) fn new(waker: Option<std::thread::Thread>) -> (WriteSlot<T>, SlotWait<T>) {
        let slot = Arc::new(Slot {
            state: Mutex::new(Answer::Waiting),
            filled: std::sync::Condvar::new(),
            waker,
        });
        (
            WriteSlot {
                slot: slot.clone(),
                answered: false,
            },
            SlotWait(slot),
        )
    }

    fn fill(&mut self, answer: Answer<T>) {
        self.answered = true;
        *self.slot.state.lock().unwrap_or_else(|e| e.into_inner()) = answer;
        self.slot.filled.notify_one();
        if let Some(t) = &self.slot.waker {
            t.unpark();
        }
    }
}

impl<T> Drop for WriteSlot<T> {
    fn drop(&mut self) {
        if !self.answered {
            self.fill(Answer::Dropped);
        }
    }
}

impl<C, T> openraft::raft::responder::Responder<C, T> for WriteSlot<T>
where
    C: openraft::RaftTypeConfig,
    T: OptionalSend + 'static,
{
    fn on_complete(mut self, result: T) {
        self.fill(Answer::Done(result));
    }
}

/// The waiting side of a [`WriteSlot`].
pub(crate) struct SlotWait<T>(Arc<Slot<T>>);

impl<T> SlotWait<T> {
    /// The answer, once there is one, waiting at most `within` (then
    /// [`Answer::Waiting`]).
    pub(crate) fn wait(&self, within: std::time::Duration) -> Answer<T> {
        let state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        let (mut state, _) = self
            .0
            .filled
            .wait_timeout_while(state, within, |s| matches!(s, Answer::Waiting))
            .unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *state, Answer::Waiting)
    }
}
