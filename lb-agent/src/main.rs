//! `lb-agent`: runs the agent, or one of the operator's commands.

use std::io::IsTerminal;

use clap::{CommandFactory, FromArgMatches};
use lb_agent::cli::{Cli, Command, LogFormat};

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only for a person at a terminal: a pipe (`kubectl logs`, a file, a test harness)
    // gets plain text. NO_COLOR (https://no-color.org) turns them off at a terminal too.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// One malloc arena for every thread, unless the operator chose (`MALLOC_ARENA_MAX`). glibc gives
/// each thread that allocates its own arena; the agent's state is built by the runtime's workers
/// and the conntrack GC thread in turn, so each arena kept its own freed pages: 4.5 MiB of the
/// resident set at 10,000 Services, for no throughput the agent needs (it allocates in bursts,
/// one sync at a time).
fn one_heap_arena() {
    #[cfg(target_env = "gnu")]
    if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
        // SAFETY: called before any other thread exists; mallopt only sets an allocator parameter.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    }
}

fn main() -> std::process::ExitCode {
    one_heap_arena();
    let matches = Cli::command().get_matches();
    let explicit = lb_agent::config::explicit_flags(&matches);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if cli.command.is_some() {
        // Operator commands behave like other Unix tools when their output is cut short
        // (`lb-agent services | head`): exit quietly on SIGPIPE instead of panicking.
        // SAFETY: restoring the default disposition of a signal has no preconditions.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    init_logging(cli.run.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let is_agent = cli.command.is_none() && !cli.run.cleanup;
    let result = runtime.block_on(async move {
        match cli.command {
            None if cli.run.cleanup => lb_agent::cleanup::run(&cli.run.bpf.root.bpf_root),
            None => lb_agent::agent::run(cli.run, explicit).await,
            Some(Command::Cleanup(args)) => lb_agent::cleanup::run(&args.bpf_root),
            Some(Command::Services(args)) => lb_agent::inspect::services(&args),
            Some(Command::Backends(args)) => lb_agent::inspect::backends(&args),
            Some(Command::Conntrack(args)) => lb_agent::inspect::conntrack(&args),
            Some(Command::Affinity(args)) => lb_agent::inspect::affinity(&args),
            Some(Command::Stats(args)) => lb_agent::inspect::stats(&args),
            Some(Command::Interfaces(args)) => lb_agent::inspect::interfaces(&args),
            Some(Command::Trace(args)) => lb_agent::trace::run(&args),
            Some(Command::Monitor(args)) => lb_agent::monitor::run(&args).await,
            Some(Command::Kernel(args)) => lb_agent::inspect::kernel(&args),
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Once. The agent logs it, in its log format, as it logs everything else (what
            // `kubectl logs` shows); the operator commands print it as Unix tools do.
            if is_agent && tracing::enabled!(tracing::Level::ERROR) {
                tracing::error!("{e:#}");
            } else {
                eprintln!("error: {e:#}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
