//! Changes made in a sandbox, as a tar in OCI image-layer form (whiteouts for deletions,
//! opaque directories): made from an overlayfs upper directory ([`layer`]) and applied to a
//! host directory safely ([`apply`]), or shown as a diff first ([`diff`]).

pub mod apply;
pub mod diff;
pub mod layer;
pub mod tar;
