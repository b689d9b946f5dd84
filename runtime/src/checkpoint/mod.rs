//! Container checkpoints with CRIU: the archive format `crictl checkpoint --export` writes and a
//! restore reads ([`archive`]), and whether CRIU works on this host ([`criu`]). The pod service
//! drives them (pods' `checkpoint` module: CheckpointContainer, and CreateContainer /
//! StartContainer of a container restored from an archive).

pub mod archive;
pub mod criu;
