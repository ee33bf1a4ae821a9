//! Everything a client can send the sampler: the bytes go through a real socket pair
//! into the sampler's connection handler (handshake, Cap'n Proto reader with the
//! sampler's limits, request validation, subscription and broker bookkeeping).
#![no_main]

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use firn_sampler::{handle_connection, Counters, Handles, Hub, Identity, Shared, Unwind};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn shared() -> Rc<Shared> {
    let counters = Rc::new(Counters::default());
    let unwind = Unwind::disabled(counters.clone());
    Rc::new(Shared {
        hub: Hub::new(4, counters.clone()),
        counters,
        identity: Identity {
            session_id: 7,
            node: "fuzz".into(),
            kernel_release: "6.18".into(),
            frequency_hz: 19,
            round_seconds: 10,
            kept_capabilities: vec!["CAP_SYS_PTRACE".into()],
            off_cpu: (0, 0, 0),
        },
        connections: Cell::new(1),
        max_connections: 4,
        write_stall_limit: std::time::Duration::from_secs(10),
        handles: Rc::new(RefCell::new(Handles::new(0))),
        unwind: Rc::new(RefCell::new(unwind)),
    })
}

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        let (mut client, server_end) = tokio::net::UnixStream::pair().expect("socketpair");
        let shared = shared();
        let handler = tokio::task::spawn_local(handle_connection(server_end, shared.clone()));
        // The server may close early (that is the point of some inputs): write errors
        // are expected, not failures.
        let _ = client.write_all(data).await;
        let _ = client.shutdown().await;
        let mut sink = vec![0u8; 64 * 1024];
        let drain = async {
            while let Ok(n) = client.read(&mut sink).await {
                if n == 0 {
                    break;
                }
            }
        };
        // The peer's EOF ends every path within milliseconds; a hang past libFuzzer's
        // -timeout is a finding.
        let _ = tokio::time::timeout(Duration::from_secs(60), drain).await;
        drop(client);
        let _ = tokio::time::timeout(Duration::from_secs(60), handler).await;
        assert_eq!(shared.connections.get(), 0, "connection not accounted for");
    });
});
