//! The loss layer, over the table: the `lost()` future of a guard and its
//! `keep_alive`. A table whose guards are never asked about loss runs
//! none of this code.

pub(crate) mod keep_alive;
pub(crate) mod lost;
