//! The two interfaces the sampler serves, `Sampler` (info, subscribe) and
//! `Subscription` (openMapping, loadUnwindTable): every request checked, refusals typed
//! and counted, malformed ones close the connection.

use std::cell::RefCell;
use std::rc::Rc;

use capnp::capability::FromServer;
use capnp::traits::HasTypeId;
use firn_logs::TokenBucket;
use firn_schema::firn_capnp::{batch_sink, sampler, subscription, Refusal, TableRefusal};
use firn_schema::PROTOCOL_VERSION;

use super::guard::{Guarded, SUBSCRIPTION_METHODS};
use super::{admit, send_loop, Conn, Shared};
use crate::counters::bump;
use crate::hub::Subscriber;

/// Unwind table chunks per subscription: sustained per second, and burst (a chunk is up
/// to 32,768 rows, so ~2 M rows a second: a busy node's binaries within seconds).
const TABLE_CHUNK_RATE: f64 = 64.0;
const TABLE_CHUNK_BURST: f64 = 256.0;

pub(super) struct SamplerImpl {
    pub(super) shared: Rc<Shared>,
    pub(super) conn: Rc<Conn>,
}

impl SamplerImpl {
    /// Whether the client speaks this protocol version. If not: counted, logged, and the
    /// connection closes once the answer is out.
    fn version_matches(&self, got: u32) -> bool {
        if got == PROTOCOL_VERSION {
            return true;
        }
        bump(&self.shared.counters.protocol_mismatches);
        tracing::warn!(
            client_version = got,
            sampler_version = PROTOCOL_VERSION,
            "client speaks another protocol version; closing its connection"
        );
        self.conn.close_soon();
        false
    }

    fn check_version(&self, got: u32) -> Result<(), capnp::Error> {
        if self.version_matches(got) {
            return Ok(());
        }
        Err(capnp::Error::failed(format!(
            "protocol version mismatch: firn-sampler speaks version {PROTOCOL_VERSION}, \
             the client sent {got}; run matching firn versions"
        )))
    }

    fn bad_request(&self, what: &str, e: capnp::Error) -> capnp::Error {
        bump(&self.shared.counters.bad_requests);
        tracing::warn!(request = what, error = %e, "malformed request; closing the connection");
        self.conn.close_soon();
        capnp::Error::failed(format!("malformed {what} request: {e}"))
    }
}

impl sampler::Server for SamplerImpl {
    fn info(
        self: Rc<Self>,
        params: sampler::InfoParams,
        mut results: sampler::InfoResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, true)?;
            let version = params
                .get()
                .map_err(|e| self.bad_request("info", e))?
                .get_protocol_version();
            let mut info = results.get().init_info();
            info.set_protocol_version(PROTOCOL_VERSION);
            info.set_sampler_version(env!("CARGO_PKG_VERSION"));
            // Another version gets the typed answer (the two version fields) and nothing
            // else; `info`'s ordinal and these fields are the frozen part of the schema.
            if !self.version_matches(version) {
                return Ok(());
            }
            let id = &self.shared.identity;
            info.set_node(id.node.as_str());
            info.set_kernel_release(id.kernel_release.as_str());
            info.set_session_id(id.session_id);
            info.set_frequency_hz(id.frequency_hz);
            info.set_round_seconds(id.round_seconds);
            info.set_off_cpu_every(id.off_cpu.0);
            info.set_off_cpu_min_ns(id.off_cpu.1);
            info.set_off_cpu_rate(id.off_cpu.2);
            let mut caps = info
                .reborrow()
                .init_kept_capabilities(id.kept_capabilities.len() as u32);
            for (i, c) in id.kept_capabilities.iter().enumerate() {
                caps.set(i as u32, c.as_str());
            }
            let counters = self.shared.counters.list();
            crate::wire::fill_counters(info.init_counters(counters.len() as u32), &counters);
            Ok(())
        })();
        std::future::ready(r)
    }

    fn subscribe(
        self: Rc<Self>,
        params: sampler::SubscribeParams,
        mut results: sampler::SubscribeResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, false)?;
            let p = params.get().map_err(|e| self.bad_request("subscribe", e))?;
            self.check_version(p.get_protocol_version())?;
            if self.conn.subscribed.replace(true) {
                return Err(self.bad_request(
                    "subscribe",
                    capnp::Error::failed("one subscription per connection".into()),
                ));
            }
            let sink: batch_sink::Client =
                p.get_sink().map_err(|e| self.bad_request("subscribe", e))?;
            let mut key = [0u8; 16];
            // SAFETY: getrandom writes at most key.len() bytes into key.
            if unsafe { libc::getrandom(key.as_mut_ptr().cast(), key.len(), 0) } != 16 {
                return Err(capnp::Error::failed(
                    "no randomness for the broker key".into(),
                ));
            }
            let sub = self.shared.hub.add(key);
            bump(&self.shared.counters.subscriptions);
            // This subscriber has been sent no code object's names yet.
            let reset = self.shared.unwind.borrow().python().forget_seen();
            crate::counters::add(&self.shared.counters.python_code_reset, reset);
            tracing::info!(subscriber = sub.id, "subscribed");
            let sender =
                tokio::task::spawn_local(send_loop(self.shared.clone(), sub.clone(), sink));
            self.conn.sender.replace(Some(sender.abort_handle()));
            let mut r = results.get();
            r.set_broker_key(&key);
            let server = SubscriptionImpl {
                sub,
                shared: self.shared.clone(),
                conn: self.conn.clone(),
                chunks: RefCell::new(TokenBucket::new(TABLE_CHUNK_RATE, TABLE_CHUNK_BURST)),
                records: RefCell::new(TokenBucket::new(
                    super::interpreter::RECORD_RATE,
                    super::interpreter::RECORD_BURST,
                )),
            };
            r.set_subscription(capnp_rpc::new_client(Guarded {
                inner: <subscription::Client as FromServer<_>>::from_server(Rc::new(server)),
                interface_id: <subscription::Client as HasTypeId>::TYPE_ID,
                methods: SUBSCRIPTION_METHODS,
                conn: self.conn.clone(),
                shared: self.shared.clone(),
            }));
            Ok(())
        })();
        std::future::ready(r)
    }
}

pub(super) struct SubscriptionImpl {
    pub(super) sub: Rc<Subscriber>,
    pub(super) shared: Rc<Shared>,
    pub(super) conn: Rc<Conn>,
    chunks: RefCell<TokenBucket>,
    /// Interpreter records (one per Python process, again after an exec or dlopen).
    pub(super) records: RefCell<TokenBucket>,
}

impl SubscriptionImpl {
    fn open(&self, process_id: u64, index: u32, version: u32) -> Result<u64, Refusal> {
        if !self.sub.rate.borrow_mut().allow() {
            return Err(Refusal::RateLimited);
        }
        let record = self
            .sub
            .record(process_id, version)
            .ok_or(Refusal::UnknownProcess)?;
        let channel = self.sub.channel.borrow();
        let channel = channel.as_ref().ok_or(Refusal::NoBrokerChannel)?;
        let fd = crate::broker::open_mapping(
            &record,
            index as usize,
            &self.shared.handles.borrow(),
            &self.shared.counters,
        )?;
        let ticket = self.sub.next_ticket.get() + 1;
        self.sub.next_ticket.set(ticket);
        crate::broker::send_fd(channel, ticket, fd)?;
        Ok(ticket)
    }

    fn count(&self, r: Refusal) {
        let c = &self.shared.counters;
        bump(match r {
            Refusal::UnknownProcess | Refusal::UnknownMapping => &c.broker_refused_unknown,
            Refusal::ProcessGone => &c.broker_refused_gone,
            Refusal::Deleted => &c.broker_refused_deleted,
            Refusal::NotRegularFile => &c.broker_refused_not_regular,
            Refusal::IdentityMismatch => &c.broker_refused_identity,
            Refusal::OpenFailed => &c.broker_refused_open,
            Refusal::RateLimited => &c.broker_refused_rate,
            Refusal::NoBrokerChannel | Refusal::ChannelFull => &c.broker_refused_channel,
            Refusal::ObsoleteUnsupported => &c.broker_refused_open,
        });
    }
}

/// What became of a table chunk.
enum Chunk {
    Taken,
    Refused(TableRefusal),
    /// Malformed rows: refused and the connection closed.
    Malformed(crate::unwind::TableError),
}

impl SubscriptionImpl {
    /// Unreadable parameters: counted, and the connection closes.
    pub(super) fn malformed(&self) {
        bump(&self.shared.counters.bad_requests);
        self.conn.close_soon();
    }

    /// A process id above any sent to this subscriber is a guess (another session's id,
    /// or a scan), not a race with a forgotten process: counted, and the connection
    /// closes.
    pub(super) fn check_issued(&self, process_id: u64, method: &str) -> Result<(), capnp::Error> {
        if process_id <= self.sub.max_sent.get() {
            return Ok(());
        }
        bump(&self.shared.counters.broker_requests_never_issued);
        tracing::warn!(
            subscriber = self.sub.id,
            process_id,
            method,
            "request for a process never sent to this subscriber; closing"
        );
        self.conn.close_soon();
        Err(capnp::Error::failed(format!(
            "{method} for a process this subscription was never sent"
        )))
    }

    fn table_chunk(&self, p: &subscription::load_unwind_table_params::Reader<'_>) -> Chunk {
        use crate::unwind::{FileKey, TableError};
        let c = &self.shared.counters;
        let mut unwind = self.shared.unwind.borrow_mut();
        if !unwind.enabled() {
            bump(&c.unwind_tables_refused_other);
            return Chunk::Refused(TableRefusal::Disabled);
        }
        if !self.chunks.borrow_mut().allow() {
            bump(&c.unwind_tables_refused_other);
            return Chunk::Refused(TableRefusal::RateLimited);
        }
        // More chunks are likely: this one's buffer may serve the next.
        crate::alloc::keep_freed();
        let Some(record) = self
            .sub
            .record(p.get_process_id(), p.get_mappings_version())
        else {
            bump(&c.unwind_tables_refused_unknown);
            return Chunk::Refused(TableRefusal::UnknownProcess);
        };
        let Some(mapping) = record.mappings.get(p.get_mapping_index() as usize) else {
            bump(&c.unwind_tables_refused_unknown);
            return Chunk::Refused(TableRefusal::UnknownMapping);
        };
        let rows = match p.get_rows() {
            Ok(r) => r,
            Err(_) => return Chunk::Malformed(TableError::Ragged),
        };
        if rows.len()
            > firn_schema::limits::MAX_TABLE_CHUNK_ROWS as usize * crate::unwind::ROW_BYTES
        {
            return Chunk::Malformed(TableError::Ragged);
        }
        match unwind.take_chunk(
            self.sub.id,
            FileKey::of(mapping),
            p.get_first_row(),
            p.get_total_rows(),
            rows,
        ) {
            Ok(done) => {
                if let Some(spent) = done {
                    tracing::info!(
                        subscriber = self.sub.id,
                        path = %String::from_utf8_lossy(&mapping.path),
                        rows = p.get_total_rows(),
                        load_us = spent.as_micros() as u64,
                        "unwind table loaded"
                    );
                }
                Chunk::Taken
            }
            Err(e) if e.is_malformed() => Chunk::Malformed(e),
            Err(e) => {
                let refusal = match e {
                    TableError::TooLarge { .. } | TableError::NoRoom { .. } => {
                        bump(&c.unwind_tables_refused_budget);
                        if matches!(e, TableError::TooLarge { .. }) {
                            TableRefusal::TooLarge
                        } else {
                            TableRefusal::NoRoom
                        }
                    }
                    TableError::NotOwner => {
                        bump(&c.unwind_tables_refused_other);
                        TableRefusal::NotOwner
                    }
                    _ => {
                        bump(&c.unwind_tables_refused_other);
                        TableRefusal::OutOfOrder
                    }
                };
                // A budget's error names the flag that raises it.
                tracing::info!(
                    subscriber = self.sub.id,
                    path = %String::from_utf8_lossy(&mapping.path),
                    error = %e,
                    "unwind table refused"
                );
                Chunk::Refused(refusal)
            }
        }
    }
}

impl subscription::Server for SubscriptionImpl {
    fn load_interpreter(
        self: Rc<Self>,
        params: subscription::LoadInterpreterParams,
        mut results: subscription::LoadInterpreterResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, false)?;
            let p = params.get().inspect_err(|_| self.malformed())?;
            self.check_issued(p.get_process_id(), "loadInterpreter")?;
            let mut out = results.get().init_result();
            match self.interpreter(&p) {
                Ok(()) => out.set_done(()),
                Err(r) => out.set_refused(r),
            }
            Ok(())
        })();
        std::future::ready(r)
    }

    fn load_unwind_table(
        self: Rc<Self>,
        params: subscription::LoadUnwindTableParams,
        mut results: subscription::LoadUnwindTableResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, false)?;
            let p = params.get().inspect_err(|_| self.malformed())?;
            self.check_issued(p.get_process_id(), "loadUnwindTable")?;
            match self.table_chunk(&p) {
                Chunk::Taken => {
                    results.get().init_result().set_done(());
                    Ok(())
                }
                Chunk::Refused(r) => {
                    results.get().init_result().set_refused(r);
                    Ok(())
                }
                Chunk::Malformed(e) => {
                    bump(&self.shared.counters.unwind_tables_refused_malformed);
                    tracing::warn!(
                        subscriber = self.sub.id,
                        error = %e,
                        "malformed unwind table; closing the connection"
                    );
                    self.conn.close_soon();
                    Err(capnp::Error::failed(format!(
                        "malformed unwind table: {e}; closing"
                    )))
                }
            }
        })();
        std::future::ready(r)
    }

    fn open_mapping(
        self: Rc<Self>,
        params: subscription::OpenMappingParams,
        mut results: subscription::OpenMappingResults,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        let r = (|| {
            admit(&self.conn, &self.shared, false)?;
            let p = params.get().inspect_err(|_| self.malformed())?;
            self.check_issued(p.get_process_id(), "openMapping")?;
            let outcome = self.open(
                p.get_process_id(),
                p.get_mapping_index(),
                p.get_mappings_version(),
            );
            let mut out = results.get().init_result();
            match outcome {
                Ok(ticket) => {
                    bump(&self.shared.counters.broker_fds_sent);
                    out.set_ticket(ticket);
                }
                Err(refusal) => {
                    self.count(refusal);
                    tracing::info!(
                        subscriber = self.sub.id,
                        process_id = p.get_process_id(),
                        mapping = p.get_mapping_index(),
                        reason = ?refusal,
                        "broker request refused"
                    );
                    out.set_refused(refusal);
                }
            }
            Ok(())
        })();
        std::future::ready(r)
    }
}

impl Drop for SubscriptionImpl {
    fn drop(&mut self) {
        tracing::info!(subscriber = self.sub.id, "unsubscribed");
        self.shared.unwind.borrow_mut().drop_owner(self.sub.id);
        self.sub.close();
    }
}
