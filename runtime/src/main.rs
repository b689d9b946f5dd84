//! `minicri`: a Kubernetes CRI runtime.
//!
//! `minicri serve` runs the daemon with embedded defaults; see `minicri serve --help`.

use clap::{Parser, Subcommand};
use minicri::{config, server};

#[derive(Parser)]
#[command(
    name = "minicri",
    version,
    about = "A Kubernetes CRI runtime: images, pods and containers on runc",
    long_about = "minicri serves the Kubernetes Container Runtime Interface (CRI v1) on a unix socket.\n\
                  Point the kubelet or crictl at it: crictl --runtime-endpoint unix:///run/minicri/minicri.sock"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the CRI daemon (needs root). Runs with built-in defaults; no config file is needed.
    Serve(Box<config::ServeArgs>),
    /// Configuration files: `minicri config default` prints the file with every setting
    /// commented out at its default; `minicri config check FILE` checks one.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Show the pulls in progress (`--watch`: live progress bars), or abort them.
    Pulls(minicri::pulls_cli::PullsArgs),
    /// Per-container monitor, started by the daemon (see `minicri::shim`).
    #[command(hide = true)]
    Shim(minicri::shim::ShimArgs),
    /// Sandbox infra process, run by the OCI runtime (see `minicri::pause`).
    #[command(hide = true)]
    Pause,
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Print /etc/minicri/config.toml as installed: every section and key, its help and its
    /// default, commented out.
    Default,
    /// Check a configuration file as `minicri serve --config FILE` reads it (no flags): unknown
    /// keys, bad values and keys of the flat form before sections are errors naming them.
    Check {
        #[arg(value_name = "FILE")]
        file: std::path::PathBuf,
    },
}

fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_new(level).unwrap_or_else(|e| {
        eprintln!("minicri: bad --log-level {level:?} ({e}); using info");
        tracing_subscriber::EnvFilter::new("info")
    });
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Shim(args) => minicri::shim::main(args),
        Command::Pause => minicri::pause::main(),
        Command::Config(ConfigCommand::Default) => match minicri::config_default::default_file() {
            Ok(text) => {
                print!("{text}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("minicri config default: {e:#}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Config(ConfigCommand::Check { file }) => match config::check_file(&file) {
            Ok(_) => {
                println!("{}: OK", file.display());
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("minicri config check: {e:#}");
                std::process::ExitCode::FAILURE
            }
        },
        Command::Pulls(args) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            match rt.block_on(minicri::pulls_cli::run(args)) {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("minicri pulls: {e:#}");
                    std::process::ExitCode::FAILURE
                }
            }
        }
        Command::Serve(args) => {
            let config = match args.resolve() {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("minicri: {e:#}");
                    return std::process::ExitCode::from(2);
                }
            };
            init_logging(&config.daemon.log_level);
            minicri::idle::limit_arenas();
            // Before any thread exists: it leaves the environment children inherit.
            let notifier = minicri::sdnotify::Notifier::from_env();
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            let served = rt.block_on(server::serve(config, notifier));
            // Dropping the runtime would wait for every blocking task without a bound.
            rt.shutdown_timeout(server::EXIT_GRACE);
            match served {
                Ok(()) => std::process::ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("minicri: {e:#}");
                    std::process::ExitCode::FAILURE
                }
            }
        }
    }
}
