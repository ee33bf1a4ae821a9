//! What a connection may say, checked before capnp-rpc or firn's methods act on it.
//!
//! - [`MessageBudget`] sees every incoming message's kind, ahead of capnp-rpc: one
//!   `Bootstrap` per connection, no `Provide`, `Accept`, `Join`, `Disembargo` or obsolete
//!   kinds (a two-party sampler never needs them), at most [`MAX_QUESTIONS`] calls left
//!   unfinished, and a message rate. capnp-rpc answers a `Bootstrap` itself and keeps
//!   each answer until a `Finish`, so without this a client could grow the sampler
//!   without ever reaching a budgeted method.
//! - [`Guarded`] wraps a generated dispatcher: a call to an interface or method the
//!   sampler does not have closes the connection.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::rc::Rc;

use capnp::capability::{DispatchCallResult, FromServer, Params, Promise, Results};
use capnp_rpc::rpc_capnp::message;
use capnp_rpc::rpc_twoparty_capnp::Side;
use capnp_rpc::{Connection, FlowController, IncomingMessage, OutgoingMessage, VatNetwork};
use firn_logs::TokenBucket;
use firn_schema::firn_capnp::{sampler, subscription};
use futures::TryFutureExt;

use super::methods::{SamplerImpl, SubscriptionImpl};
use super::{Conn, Shared};
use crate::counters::{bump, Counters};

/// Calls (and Bootstraps) a connection may leave without a `Finish` at once. The
/// enricher has a handful in flight.
pub(crate) const MAX_QUESTIONS: usize = 256;
/// Incoming messages per connection: sustained per second, and burst. Each call brings
/// two (the call and its `Finish`), so this sits above the call budget.
const MESSAGE_RATE: f64 = 1_000.0;
const MESSAGE_BURST: f64 = 10_000.0;

/// The first segment of every outgoing message, in words: 128 KiB, the allocator's
/// threshold for a block of its own (`trim.rs`), and every later segment is larger. A
/// message's segments are then mapped when it is built and unmapped once it is written,
/// instead of coming from the heap, whose freed pages stay resident after confinement
/// (capnp-rpc asks for 1,024 words whatever the message). A fresh mapping is zero
/// without being touched, so a small message still costs only the pages it fills.
const MAPPED_SEGMENT_WORDS: u32 = (128 << 10) / 8;

/// The per-connection message checks.
pub(crate) struct MessageBudget {
    bootstraps: Cell<u32>,
    questions: RefCell<HashSet<u32>>,
    rate: RefCell<TokenBucket>,
    /// Why the connection was refused, once it was (its counter is already bumped).
    refused: Cell<Option<&'static str>>,
    counters: Rc<Counters>,
}

impl MessageBudget {
    pub(crate) fn new(counters: Rc<Counters>) -> Self {
        Self {
            bootstraps: Cell::new(0),
            questions: RefCell::new(HashSet::new()),
            rate: RefCell::new(TokenBucket::new(MESSAGE_RATE, MESSAGE_BURST)),
            refused: Cell::new(None),
            counters,
        }
    }

    /// Whether a check closed the connection (and counted it).
    pub(crate) fn refused(&self) -> Option<&'static str> {
        self.refused.get()
    }

    fn refuse(&self, why: &'static str, counter: &Cell<u64>) -> capnp::Error {
        if self.refused.replace(Some(why)).is_none() {
            bump(counter);
            tracing::warn!(reason = why, "closing a connection");
        }
        capnp::Error::failed(format!("{why}; closing the connection"))
    }

    fn ask(&self, question: u32) -> Result<(), capnp::Error> {
        let mut q = self.questions.borrow_mut();
        if q.len() >= MAX_QUESTIONS {
            return Err(self.refuse(
                "too many calls left unfinished",
                &self.counters.rpc_questions_refused,
            ));
        }
        if !q.insert(question) {
            return Err(self.refuse(
                "a question id already in use",
                &self.counters.rpc_messages_refused,
            ));
        }
        Ok(())
    }

    /// Notes an answer this side sends: one that says `noFinishNeeded` (capnp-rpc sets
    /// it when the results hold no capability) ends its question, and the peer may
    /// reuse the id without a `Finish`.
    fn sending(&self, msg: &dyn OutgoingMessage) {
        let Ok(body) = msg.get_body_as_reader() else {
            return;
        };
        let Ok(m) = body.get_as::<message::Reader<'_>>() else {
            return;
        };
        if let Ok(message::Return(Ok(ret))) = m.which() {
            if ret.get_no_finish_needed() {
                self.questions.borrow_mut().remove(&ret.get_answer_id());
            }
        }
    }

    /// Checks one incoming message; an error ends the connection.
    pub(crate) fn check(&self, msg: &dyn IncomingMessage) -> Result<(), capnp::Error> {
        let c = &self.counters;
        if self.refused.get().is_some() {
            return Err(capnp::Error::failed("connection refused".into()));
        }
        if !self.rate.borrow_mut().allow() {
            return Err(self.refuse("messages faster than allowed", &c.message_floods));
        }
        let m: message::Reader<'_> = msg.get_body()?.get_as()?;
        match m.which() {
            Ok(message::Bootstrap(b)) => {
                if self.bootstraps.replace(self.bootstraps.get() + 1) > 0 {
                    return Err(self.refuse("a second Bootstrap", &c.rpc_bootstraps_refused));
                }
                self.ask(b?.get_question_id())
            }
            Ok(message::Call(call)) => self.ask(call?.get_question_id()),
            Ok(message::Finish(f)) => {
                self.questions.borrow_mut().remove(&f?.get_question_id());
                Ok(())
            }
            Ok(
                message::Unimplemented(_)
                | message::Abort(_)
                | message::Return(_)
                | message::Resolve(_)
                | message::Release(_),
            ) => Ok(()),
            Ok(
                message::Provide(_)
                | message::Accept(_)
                | message::Join(_)
                | message::Disembargo(_)
                | message::ObsoleteSave(_)
                | message::ObsoleteDelete(_),
            )
            | Err(_) => Err(self.refuse(
                "a message kind this sampler never accepts",
                &c.rpc_messages_refused,
            )),
        }
    }
}

/// A vat network whose connections pass every incoming message through a
/// [`MessageBudget`] first.
pub(crate) struct GuardedNetwork<N> {
    pub(crate) inner: N,
    pub(crate) budget: Rc<MessageBudget>,
}

struct GuardedConnection {
    inner: Box<dyn Connection<Side>>,
    budget: Rc<MessageBudget>,
}

impl<N: VatNetwork<Side>> VatNetwork<Side> for GuardedNetwork<N> {
    fn connect(&mut self, host: Side) -> Option<Box<dyn Connection<Side>>> {
        let budget = self.budget.clone();
        self.inner
            .connect(host)
            .map(|inner| Box::new(GuardedConnection { inner, budget }) as Box<dyn Connection<Side>>)
    }

    fn accept(&mut self) -> Promise<Box<dyn Connection<Side>>, capnp::Error> {
        let budget = self.budget.clone();
        Promise::from_future(self.inner.accept().map_ok(move |inner| {
            Box::new(GuardedConnection { inner, budget }) as Box<dyn Connection<Side>>
        }))
    }

    fn drive_until_shutdown(&mut self) -> Promise<(), capnp::Error> {
        self.inner.drive_until_shutdown()
    }
}

/// An outgoing message, watched for the answers that need no `Finish`.
struct GuardedOutgoing {
    inner: Box<dyn OutgoingMessage>,
    budget: Rc<MessageBudget>,
}

impl OutgoingMessage for GuardedOutgoing {
    fn get_body(&mut self) -> capnp::Result<capnp::any_pointer::Builder<'_>> {
        self.inner.get_body()
    }

    fn get_body_as_reader(&self) -> capnp::Result<capnp::any_pointer::Reader<'_>> {
        self.inner.get_body_as_reader()
    }

    fn send(
        self: Box<Self>,
    ) -> (
        Promise<(), capnp::Error>,
        Rc<capnp::message::Builder<capnp::message::HeapAllocator>>,
    ) {
        self.budget.sending(self.inner.as_ref());
        self.inner.send()
    }

    fn take(self: Box<Self>) -> capnp::message::Builder<capnp::message::HeapAllocator> {
        self.inner.take()
    }

    fn size_in_words(&self) -> usize {
        self.inner.size_in_words()
    }
}

impl Connection<Side> for GuardedConnection {
    fn get_peer_vat_id(&self) -> Side {
        self.inner.get_peer_vat_id()
    }

    fn new_outgoing_message(&mut self, first_segment_words: u32) -> Box<dyn OutgoingMessage> {
        Box::new(GuardedOutgoing {
            inner: self
                .inner
                .new_outgoing_message(first_segment_words.max(MAPPED_SEGMENT_WORDS)),
            budget: self.budget.clone(),
        })
    }

    fn receive_incoming_message(
        &mut self,
    ) -> Promise<Option<Box<dyn IncomingMessage>>, capnp::Error> {
        let next = self.inner.receive_incoming_message();
        let budget = self.budget.clone();
        Promise::from_future(async move {
            let msg = next.await?;
            if let Some(m) = &msg {
                budget.check(m.as_ref())?;
            }
            Ok(msg)
        })
    }

    fn new_stream(&mut self) -> (Box<dyn FlowController>, Promise<(), capnp::Error>) {
        self.inner.new_stream()
    }

    fn shutdown(&mut self, result: capnp::Result<()>) -> Promise<(), capnp::Error> {
        self.inner.shutdown(result)
    }
}

/// Methods of each interface in the schema (`@0`..): a call past them is a client
/// this sampler was not built for, or a probe.
pub(crate) const SAMPLER_METHODS: u16 = 2;
pub(crate) const SUBSCRIPTION_METHODS: u16 = 3;

/// A generated dispatcher behind a check: a call to an interface or method the sampler
/// does not have is counted and closes the connection. capnp-rpc alone would answer
/// "unimplemented" and keep serving whatever the client tries next.
pub(crate) struct Guarded<D> {
    pub(crate) inner: D,
    pub(crate) interface_id: u64,
    pub(crate) methods: u16,
    pub(crate) conn: Rc<Conn>,
    pub(crate) shared: Rc<Shared>,
}

pub(crate) struct GuardedDispatch<D>(Rc<Guarded<D>>);

impl<D> Clone for GuardedDispatch<D> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<D> std::ops::Deref for GuardedDispatch<D> {
    type Target = Guarded<D>;
    fn deref(&self) -> &Guarded<D> {
        &self.0
    }
}

impl<D: capnp::capability::Server + Clone> capnp::capability::Server for GuardedDispatch<D> {
    fn dispatch_call(
        self,
        interface_id: u64,
        method_id: u16,
        params: Params<capnp::any_pointer::Owned>,
        results: Results<capnp::any_pointer::Owned>,
    ) -> DispatchCallResult {
        let g = &self.0;
        if interface_id == g.interface_id && method_id < g.methods {
            return g
                .inner
                .clone()
                .dispatch_call(interface_id, method_id, params, results);
        }
        bump(&g.shared.counters.unknown_methods);
        tracing::warn!(
            interface_id = format_args!("{interface_id:#x}"),
            method_id,
            "call to a method this sampler does not have; closing the connection"
        );
        g.conn.close_soon();
        DispatchCallResult::new(
            Promise::err(capnp::Error::unimplemented(format!(
                "firn-sampler has no method {method_id} on interface {interface_id:#x}; \
                 closing the connection"
            ))),
            false,
        )
    }

    fn as_ptr(&self) -> usize {
        self.0.inner.as_ptr()
    }
}

impl FromServer<Guarded<sampler::ServerDispatch<SamplerImpl>>> for sampler::Client {
    type Dispatch = GuardedDispatch<sampler::ServerDispatch<SamplerImpl>>;
    fn from_server(s: Rc<Guarded<sampler::ServerDispatch<SamplerImpl>>>) -> Self::Dispatch {
        GuardedDispatch(s)
    }
}

impl FromServer<Guarded<subscription::ServerDispatch<SubscriptionImpl>>> for subscription::Client {
    type Dispatch = GuardedDispatch<subscription::ServerDispatch<SubscriptionImpl>>;
    fn from_server(
        s: Rc<Guarded<subscription::ServerDispatch<SubscriptionImpl>>>,
    ) -> Self::Dispatch {
        GuardedDispatch(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Msg(capnp::message::Builder<capnp::message::HeapAllocator>);

    impl IncomingMessage for Msg {
        fn get_body(&self) -> capnp::Result<capnp::any_pointer::Reader<'_>> {
            self.0.get_root_as_reader()
        }
    }

    fn msg(fill: impl FnOnce(message::Builder<'_>)) -> Msg {
        let mut b = capnp::message::Builder::new_default();
        fill(b.init_root::<message::Builder<'_>>());
        Msg(b)
    }

    fn bootstrap(q: u32) -> Msg {
        msg(|m| m.init_bootstrap().set_question_id(q))
    }

    fn call(q: u32) -> Msg {
        msg(|m| m.init_call().set_question_id(q))
    }

    fn finish(q: u32) -> Msg {
        msg(|m| m.init_finish().set_question_id(q))
    }

    #[test]
    fn one_bootstrap_per_connection() {
        let c = Rc::new(Counters::default());
        let b = MessageBudget::new(c.clone());
        assert!(b.check(&bootstrap(0)).is_ok());
        assert!(b.check(&bootstrap(1)).is_err());
        assert_eq!(c.rpc_bootstraps_refused.get(), 1);
        assert!(b.refused().is_some());
        // Once refused, nothing more is taken.
        assert!(b.check(&finish(0)).is_err());
        assert_eq!(c.rpc_bootstraps_refused.get(), 1, "counted once");
    }

    #[test]
    fn unfinished_calls_are_bounded_and_finish_frees_them() {
        let c = Rc::new(Counters::default());
        let b = MessageBudget::new(c.clone());
        for q in 0..MAX_QUESTIONS as u32 {
            assert!(b.check(&call(q)).is_ok());
        }
        // Finishing one makes room for one; a reused id in flight is refused.
        assert!(b.check(&finish(7)).is_ok());
        assert!(b.check(&call(7)).is_ok());
        assert!(b.check(&call(100_000)).is_err());
        assert_eq!(c.rpc_questions_refused.get(), 1);
        let b = MessageBudget::new(c.clone());
        assert!(b.check(&call(1)).is_ok());
        assert!(b.check(&call(1)).is_err(), "question id in use");
        assert_eq!(c.rpc_messages_refused.get(), 1);
    }

    #[test]
    fn three_party_and_embargo_messages_close() {
        for m in [
            msg(|m| {
                m.init_provide().set_question_id(1);
            }),
            msg(|m| {
                m.init_accept().set_question_id(1);
            }),
            msg(|m| {
                m.init_join().set_question_id(1);
            }),
            msg(|m| {
                m.init_disembargo().init_context().set_sender_loopback(1);
            }),
        ] {
            let c = Rc::new(Counters::default());
            let b = MessageBudget::new(c.clone());
            assert!(b.check(&m).is_err());
            assert_eq!(c.rpc_messages_refused.get(), 1);
        }
    }

    #[test]
    fn a_message_flood_closes() {
        let c = Rc::new(Counters::default());
        let b = MessageBudget::new(c.clone());
        let refused = (0..MESSAGE_BURST as u32 + 10)
            .map(|_| b.check(&finish(0)))
            .any(|r| r.is_err());
        assert!(refused);
        assert_eq!(c.message_floods.get(), 1);
    }
}
