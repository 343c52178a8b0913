//! Shared command-line conventions: one-line errors on stderr and exit status 1.

/// Prints `<tool>: error: <message>` (the whole cause chain on one line) and exits 1 on error.
pub fn exit_on_error(tool: &str, result: anyhow::Result<()>) {
    if let Err(err) = result {
        let chain: Vec<String> = err.chain().map(|c| c.to_string()).collect();
        let mut message = chain.join(": ");
        // Sources are often already quoted by their parent's message; avoid saying it twice.
        if chain.len() > 1 && chain[0].ends_with(&chain[1]) {
            message = chain[0].clone();
        }
        eprintln!("{tool}: error: {}", message.replace('\n', " "));
        std::process::exit(1);
    }
}

/// Turns a flag parser's `Result<T, String>` into an `anyhow` error carrying its message.
pub fn parse_flag<T>(parsed: Result<T, String>) -> anyhow::Result<T> {
    parsed.map_err(anyhow::Error::msg)
}
