//! Changes made in a sandbox, as a tar in OCI image-layer form (whiteouts for deletions,
//! opaque directories), and applying them to a host directory safely ([`apply`]).

pub mod apply;
pub mod tar;
