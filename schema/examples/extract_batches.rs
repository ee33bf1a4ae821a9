//! Seeds for the enricher's fuzz target from captured traffic: reads a sampler→enricher
//! byte stream (as `fuzz/capture.py` records it), finds every `BatchSink.push` call and
//! writes its `Batch` as a standalone Cap'n Proto message, one file each.
//!
//! `cargo run --release -p firn-schema --example extract_batches -- STREAM OUT_DIR`

use capnp::message::ReaderOptions;
use capnp_rpc::rpc_capnp::message;
use firn_schema::firn_capnp::batch_sink;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, stream, out] = &args[..] else {
        return Err("usage: extract_batches STREAM OUT_DIR".into());
    };
    let data = std::fs::read(stream)?;
    std::fs::create_dir_all(out)?;
    let mut rest = &data[..];
    let (mut messages, mut written) = (0, 0);
    let opts = *ReaderOptions::new().traversal_limit_in_words(Some(1 << 28));
    while !rest.is_empty() {
        let msg = capnp::serialize::read_message_from_flat_slice(&mut rest, opts)?;
        messages += 1;
        let Ok(message::Call(call)) = msg.get_root::<message::Reader>()?.which() else {
            continue;
        };
        let call = call?;
        let content = call.get_params()?.get_content();
        let Ok(push) = content.get_as::<batch_sink::push_params::Reader>() else {
            continue;
        };
        let Ok(batch) = push.get_batch() else {
            continue;
        };
        let mut b = capnp::message::Builder::new_default();
        b.set_root(batch)?;
        let path = format!("{out}/seed-batch-{written:03}");
        std::fs::write(&path, capnp::serialize::write_message_to_words(&b))?;
        written += 1;
    }
    eprintln!("{messages} messages, {written} batches written to {out}");
    Ok(())
}
