//! `loadInterpreter`: a CPython record for one process, checked and placed by
//! `unwind::python`, refused with a reason otherwise (each counted there or here).

use firn_schema::firn_capnp::{subscription, InterpreterRefusal};

use super::methods::SubscriptionImpl;
use crate::counters::bump;
use crate::unwind::python::InterpreterError;

/// Records per subscription: sustained per second, and burst (one per Python process,
/// again after an exec or a dlopen: a node's Python processes within seconds).
pub(super) const RECORD_RATE: f64 = 32.0;
pub(super) const RECORD_BURST: f64 = 256.0;

impl SubscriptionImpl {
    pub(super) fn interpreter(
        &self,
        p: &subscription::load_interpreter_params::Reader<'_>,
    ) -> Result<(), InterpreterRefusal> {
        let c = &self.shared.counters;
        let mut unwind = self.shared.unwind.borrow_mut();
        if !unwind.enabled() || !unwind.python().enabled() {
            bump(&c.python_interpreters_refused_other);
            return Err(InterpreterRefusal::Disabled);
        }
        if !self.records.borrow_mut().allow() {
            bump(&c.python_interpreters_refused_other);
            return Err(InterpreterRefusal::RateLimited);
        }
        let Some(record) = self
            .sub
            .record(p.get_process_id(), p.get_mappings_version())
        else {
            bump(&c.python_interpreters_refused_other);
            return Err(InterpreterRefusal::UnknownProcess);
        };
        let Some(mapping) = record.mappings.get(p.get_mapping_index() as usize) else {
            bump(&c.python_interpreters_refused_other);
            return Err(InterpreterRefusal::UnknownMapping);
        };
        let bytes = p.get_record().unwrap_or_default();
        let r = unwind.load_interpreter(self.sub.id, record.pid, record.start_ns, mapping, bytes);
        let path = String::from_utf8_lossy(&mapping.path);
        match r {
            Ok(()) => {
                self.sub
                    .note_interpreter((mapping.dev_major, mapping.dev_minor, mapping.inode));
                tracing::info!(subscriber = self.sub.id, pid = record.pid, path = %path, "Python interpreter loaded");
                Ok(())
            }
            Err(e) => {
                tracing::info!(subscriber = self.sub.id, pid = record.pid, path = %path, error = %e, "Python interpreter refused");
                Err(match e {
                    InterpreterError::Malformed | InterpreterError::Invalid(_) => {
                        InterpreterRefusal::Invalid
                    }
                    InterpreterError::Outside => InterpreterRefusal::OutsideMapping,
                    InterpreterError::UnknownProcess => InterpreterRefusal::UnknownProcess,
                    InterpreterError::NotOwner => InterpreterRefusal::NotOwner,
                    InterpreterError::NoRoom | InterpreterError::Map(_) => {
                        InterpreterRefusal::NoRoom
                    }
                })
            }
        }
    }
}
