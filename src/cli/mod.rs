//! The bodies of `kvflow`'s subcommands, each beside the clap arguments only it takes; src/main.rs
//! holds the command tree and hands each subcommand to its module here.

pub mod bench;
pub mod check;
pub mod compare;
pub mod generate;
pub mod plan;
pub mod run;
