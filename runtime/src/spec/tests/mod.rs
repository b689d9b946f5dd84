//! Unit tests of spec building, by the spec they build; no root needed.

mod container;
mod sandbox;
