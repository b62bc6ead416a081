//! `cargo run --release -p train -- [--devices 0,1|cpu|cpu:N] [--config FILE] ...` and its
//! subcommands (`eval`, `detect`, `export`, `import-config`, `import-checkpoint`, `plot`).

mod cli;

fn main() -> anyhow::Result<std::process::ExitCode> {
    cli::main()
}
