//! `lb-agent`: runs the agent, or one of the operator's commands.

use clap::Parser;
use lb_agent::cli::{Cli, Command, LogFormat};

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logging(cli.run.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            None if cli.run.cleanup => lb_agent::cleanup::run(&cli.run.bpf.root.bpf_root),
            None => lb_agent::run::run(cli.run).await,
            Some(Command::Cleanup(args)) => lb_agent::cleanup::run(&args.bpf_root),
            Some(Command::Services(args)) => lb_agent::inspect::services(&args),
            Some(Command::Backends(args)) => lb_agent::inspect::backends(&args),
            Some(Command::Trace(args)) => lb_agent::trace::run(&args),
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
