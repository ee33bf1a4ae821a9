fn main() {
    capnpc::CompilerCommand::new()
        .src_prefix("schema")
        .file("schema/firn.capnp")
        .run()
        .expect("compiling schema/firn.capnp needs the capnp compiler (apt-get install capnproto)");
    println!("cargo:rerun-if-changed=schema/firn.capnp");
}
