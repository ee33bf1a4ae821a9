//! Parca's gRPC messages that firn sends and reads, declared with prost's derive (no
//! Rust crate publishes them). Field numbers follow `parca/profilestore/v1alpha1` and
//! `parca/debuginfo/v1alpha1`; the tests decode what firn sends with Parca's own
//! published client types (`@parca/client`), which checks these numbers. (`prost` in
//! this crate is pprof's older version; these derive with 0.14, tonic's.)

use prost14::{Message, Oneof};

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct WriteRawRequest {
    #[prost(string, tag = "1")]
    pub tenant: String,
    #[prost(message, repeated, tag = "2")]
    pub series: Vec<RawProfileSeries>,
    #[prost(bool, tag = "3")]
    pub normalized: bool,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct WriteRawResponse {}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct RawProfileSeries {
    #[prost(message, optional, tag = "1")]
    pub labels: Option<LabelSet>,
    #[prost(message, repeated, tag = "2")]
    pub samples: Vec<RawSample>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct LabelSet {
    #[prost(message, repeated, tag = "1")]
    pub labels: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct Label {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct RawSample {
    #[prost(bytes = "vec", tag = "1")]
    pub raw_profile: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub executable_info: Vec<ExecutableInfo>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct ExecutableInfo {
    #[prost(uint32, tag = "1")]
    pub elf_type: u32,
    #[prost(message, optional, tag = "2")]
    pub load_segment: Option<LoadSegment>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct LoadSegment {
    #[prost(uint64, tag = "1")]
    pub offset: u64,
    #[prost(uint64, tag = "2")]
    pub vaddr: u64,
}

/// `DebuginfoType` EXECUTABLE.
pub const DEBUGINFO_TYPE_EXECUTABLE: i32 = 1;
/// `BuildIDType` GNU.
pub const BUILD_ID_TYPE_GNU: i32 = 1;
/// `UploadInstructions.UploadStrategy`.
pub const UPLOAD_STRATEGY_GRPC: i32 = 1;

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct ShouldInitiateUploadRequest {
    #[prost(string, tag = "1")]
    pub build_id: String,
    #[prost(string, tag = "2")]
    pub hash: String,
    #[prost(bool, tag = "3")]
    pub force: bool,
    #[prost(int32, tag = "4")]
    pub r#type: i32,
    #[prost(int32, tag = "5")]
    pub build_id_type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct ShouldInitiateUploadResponse {
    #[prost(bool, tag = "1")]
    pub should_initiate_upload: bool,
    #[prost(string, tag = "2")]
    pub reason: String,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct InitiateUploadRequest {
    #[prost(string, tag = "1")]
    pub build_id: String,
    #[prost(int64, tag = "2")]
    pub size: i64,
    #[prost(string, tag = "3")]
    pub hash: String,
    #[prost(bool, tag = "4")]
    pub force: bool,
    #[prost(int32, tag = "5")]
    pub r#type: i32,
    #[prost(int32, tag = "6")]
    pub build_id_type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct InitiateUploadResponse {
    #[prost(message, optional, tag = "1")]
    pub upload_instructions: Option<UploadInstructions>,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct UploadInstructions {
    #[prost(string, tag = "1")]
    pub build_id: String,
    #[prost(string, tag = "2")]
    pub upload_id: String,
    #[prost(int32, tag = "3")]
    pub upload_strategy: i32,
    #[prost(string, tag = "4")]
    pub signed_url: String,
    #[prost(int32, tag = "5")]
    pub r#type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct UploadRequest {
    #[prost(oneof = "upload_request::Data", tags = "1, 2")]
    pub data: Option<upload_request::Data>,
}

pub mod upload_request {
    use super::*;

    #[derive(Clone, PartialEq, Oneof)]
    #[prost(prost_path = "::prost14")]
    pub enum Data {
        #[prost(message, tag = "1")]
        Info(UploadInfo),
        #[prost(bytes = "vec", tag = "2")]
        ChunkData(Vec<u8>),
    }
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct UploadInfo {
    #[prost(string, tag = "1")]
    pub build_id: String,
    #[prost(string, tag = "2")]
    pub upload_id: String,
    #[prost(int32, tag = "3")]
    pub r#type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct UploadResponse {
    #[prost(string, tag = "1")]
    pub build_id: String,
    #[prost(uint64, tag = "2")]
    pub size: u64,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct MarkUploadFinishedRequest {
    #[prost(string, tag = "1")]
    pub build_id: String,
    #[prost(string, tag = "2")]
    pub upload_id: String,
    #[prost(int32, tag = "3")]
    pub r#type: i32,
}

#[derive(Clone, PartialEq, Message)]
#[prost(prost_path = "::prost14")]
pub struct MarkUploadFinishedResponse {}
