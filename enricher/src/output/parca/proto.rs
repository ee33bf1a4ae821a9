//! Parca's gRPC messages that firn sends and reads, declared with prost's derive (no
//! Rust crate publishes them). Field numbers follow `parca/profilestore/v1alpha1` and
//! `parca/debuginfo/v1alpha1`; the tests decode what firn sends with Parca's own
//! published client types (`@parca/client`), which checks these numbers. (`prost` in
//! this crate is pprof's older version; these derive with 0.14, tonic's.)

use prost14::{Message, Oneof};

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct WriteRawRequest {
    #[prost(string, tag = "1")]
    pub(crate) tenant: String,
    #[prost(message, repeated, tag = "2")]
    pub(crate) series: Vec<RawProfileSeries>,
    #[prost(bool, tag = "3")]
    pub(crate) normalized: bool,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct WriteRawResponse {}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct RawProfileSeries {
    #[prost(message, optional, tag = "1")]
    pub(crate) labels: Option<LabelSet>,
    #[prost(message, repeated, tag = "2")]
    pub(crate) samples: Vec<RawSample>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct LabelSet {
    #[prost(message, repeated, tag = "1")]
    pub(crate) labels: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct Label {
    #[prost(string, tag = "1")]
    pub(crate) name: String,
    #[prost(string, tag = "2")]
    pub(crate) value: String,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct RawSample {
    #[prost(bytes = "vec", tag = "1")]
    pub(crate) raw_profile: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub(crate) executable_info: Vec<ExecutableInfo>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct ExecutableInfo {
    #[prost(uint32, tag = "1")]
    pub(crate) elf_type: u32,
    #[prost(message, optional, tag = "2")]
    pub(crate) load_segment: Option<LoadSegment>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct LoadSegment {
    #[prost(uint64, tag = "1")]
    pub(crate) offset: u64,
    #[prost(uint64, tag = "2")]
    pub(crate) vaddr: u64,
}

/// `DebuginfoType` EXECUTABLE.
pub(crate) const DEBUGINFO_TYPE_EXECUTABLE: i32 = 1;
/// `BuildIDType` GNU.
pub(crate) const BUILD_ID_TYPE_GNU: i32 = 1;
/// `UploadInstructions.UploadStrategy`.
pub(crate) const UPLOAD_STRATEGY_GRPC: i32 = 1;

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct ShouldInitiateUploadRequest {
    #[prost(string, tag = "1")]
    pub(crate) build_id: String,
    #[prost(string, tag = "2")]
    pub(crate) hash: String,
    #[prost(bool, tag = "3")]
    pub(crate) force: bool,
    #[prost(int32, tag = "4")]
    pub r#type: i32,
    #[prost(int32, tag = "5")]
    pub(crate) build_id_type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct ShouldInitiateUploadResponse {
    #[prost(bool, tag = "1")]
    pub(crate) should_initiate_upload: bool,
    #[prost(string, tag = "2")]
    pub(crate) reason: String,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct InitiateUploadRequest {
    #[prost(string, tag = "1")]
    pub(crate) build_id: String,
    #[prost(int64, tag = "2")]
    pub(crate) size: i64,
    #[prost(string, tag = "3")]
    pub(crate) hash: String,
    #[prost(bool, tag = "4")]
    pub(crate) force: bool,
    #[prost(int32, tag = "5")]
    pub r#type: i32,
    #[prost(int32, tag = "6")]
    pub(crate) build_id_type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct InitiateUploadResponse {
    #[prost(message, optional, tag = "1")]
    pub(crate) upload_instructions: Option<UploadInstructions>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct UploadInstructions {
    #[prost(string, tag = "1")]
    pub(crate) build_id: String,
    #[prost(string, tag = "2")]
    pub(crate) upload_id: String,
    #[prost(int32, tag = "3")]
    pub(crate) upload_strategy: i32,
    #[prost(string, tag = "4")]
    pub(crate) signed_url: String,
    #[prost(int32, tag = "5")]
    pub r#type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct UploadRequest {
    #[prost(oneof = "upload_request::Data", tags = "1, 2")]
    pub(crate) data: Option<upload_request::Data>,
}

pub(crate) mod upload_request {
    use super::*;

    #[derive(Clone, PartialEq, Oneof)]
    #[prost(prost_path = "::prost14")]
    pub(crate) enum Data {
        #[prost(message, tag = "1")]
        Info(UploadInfo),
        #[prost(bytes = "vec", tag = "2")]
        ChunkData(Vec<u8>),
    }
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct UploadInfo {
    #[prost(string, tag = "1")]
    pub(crate) build_id: String,
    #[prost(string, tag = "2")]
    pub(crate) upload_id: String,
    #[prost(int32, tag = "3")]
    pub r#type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct UploadResponse {
    #[prost(string, tag = "1")]
    pub(crate) build_id: String,
    #[prost(uint64, tag = "2")]
    pub(crate) size: u64,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct MarkUploadFinishedRequest {
    #[prost(string, tag = "1")]
    pub(crate) build_id: String,
    #[prost(string, tag = "2")]
    pub(crate) upload_id: String,
    #[prost(int32, tag = "3")]
    pub r#type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub(crate) struct MarkUploadFinishedResponse {}
