//! (Tests only.) The lb-agent recipe against manifests/Dockerfile and manifests/daemonset.yaml:
//! a Dockerfile reader, where the last stage and a [`Recipe`] disagree, and the commands a shell
//! script runs.

use std::path::Path;

use super::Recipe;

/// One instruction of a Dockerfile, with the line it starts on.
#[derive(Debug)]
struct Instruction {
    line: usize,
    keyword: String,
    rest: String,
}

/// Instructions with continuation lines joined; comments and blank lines dropped.
fn dockerfile_instructions(text: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if current.is_none() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        if current.is_some() && trimmed.starts_with('#') {
            continue;
        }
        let (continues, body) = match trimmed.strip_suffix('\\') {
            Some(body) => (true, body.trim_end()),
            None => (false, trimmed),
        };
        let (line, mut joined) = current.take().unwrap_or((i + 1, String::new()));
        if !joined.is_empty() && !body.is_empty() {
            joined.push(' ');
        }
        joined.push_str(body);
        if continues {
            current = Some((line, joined));
        } else if !joined.is_empty() {
            let (keyword, rest) = joined.split_once(char::is_whitespace).unwrap_or((&joined, ""));
            out.push(Instruction {
                line,
                keyword: keyword.to_ascii_uppercase(),
                rest: rest.trim().to_string(),
            });
        }
    }
    out
}

/// Where the last stage of the Dockerfile `text` and `recipe` disagree, one message per line of
/// the Dockerfile (empty: they agree).
fn dockerfile_disagreements(text: &str, recipe: &Recipe) -> Vec<String> {
    const FILE: &str = "manifests/Dockerfile";
    let instructions = dockerfile_instructions(text);
    let Some(start) = instructions.iter().rposition(|i| i.keyword == "FROM") else {
        return vec![format!("{FILE}: no FROM instruction")];
    };
    let stage = &instructions[start..];
    let mut problems = Vec::new();
    let mut at = |i: &Instruction, what: String| {
        problems.push(format!("{FILE}:{}: `{} {}`: {what}", i.line, i.keyword, i.rest));
    };
    let json_array = |rest: &str| serde_json::from_str::<Vec<String>>(rest).ok();
    let (mut copied, mut user, mut entrypoint) = (false, false, false);
    for i in stage {
        match i.keyword.as_str() {
            "FROM" => {
                let image = i
                    .rest
                    .split_whitespace()
                    .find(|w| !w.starts_with("--"))
                    .unwrap_or_default();
                if Some(image) != recipe.base {
                    at(i, format!("the local image stands in for {:?}", recipe.base));
                }
            }
            "COPY" => {
                let words: Vec<&str> = i.rest.split_whitespace().collect();
                let (flags, paths): (Vec<&str>, Vec<&str>) =
                    words.into_iter().partition(|w| w.starts_with("--"));
                if flags.iter().any(|f| *f != "--from=build" && *f != "--link") {
                    at(
                        i,
                        "the local image models only `COPY --from=build /out/lb-agent <dest>`".into(),
                    );
                    continue;
                }
                let Some((dest, sources)) = paths.split_last() else {
                    at(i, "COPY without a destination".into());
                    continue;
                };
                if flags.is_empty() || sources != ["/out/lb-agent"] {
                    at(
                        i,
                        "the local image copies only the build stage's /out/lb-agent".into(),
                    );
                    continue;
                }
                let dest = if dest.ends_with('/') {
                    format!("{dest}lb-agent")
                } else {
                    dest.to_string()
                };
                if dest != recipe.program {
                    at(i, format!("the local image has the binary at {}", recipe.program));
                }
                copied = true;
            }
            "USER" => {
                user = true;
                if i.rest != recipe.user {
                    at(i, format!("the local image's config has User {:?}", recipe.user));
                }
            }
            "ENTRYPOINT" => {
                entrypoint = true;
                match json_array(&i.rest) {
                    Some(e) if e == recipe.entrypoint => {}
                    _ => at(
                        i,
                        format!("the local image's Entrypoint is {:?}", recipe.entrypoint),
                    ),
                }
            }
            "CMD" => match json_array(&i.rest) {
                Some(c) if c == recipe.cmd => {}
                _ => at(i, format!("the local image's Cmd is {:?}", recipe.cmd)),
            },
            "WORKDIR" if i.rest == "/" => {}
            _ => at(
                i,
                "not modelled by the local image recipe (xtask/src/image/recipes.rs): add it there too"
                    .into(),
            ),
        }
    }
    let from = &stage[0];
    if !copied {
        at(
            from,
            format!("this stage copies no lb-agent to {}", recipe.program),
        );
    }
    if !user {
        at(
            from,
            format!("this stage has no USER; the local image's is {:?}", recipe.user),
        );
    }
    if !entrypoint {
        at(
            from,
            format!(
                "this stage has no ENTRYPOINT; the local image's is {:?}",
                recipe.entrypoint
            ),
        );
    }
    problems
}

/// The external commands a shell script runs (first words of its simple commands, including
/// those in `$(...)`), without shell keywords and dash's builtins.
fn script_commands(script: &str) -> Vec<String> {
    const KEYWORDS: &[&str] = &[
        "if", "then", "else", "elif", "fi", "while", "until", "do", "done", "for", "case", "esac", "!", "{",
        "}",
    ];
    const BUILTINS: &[&str] = &[
        ":", ".", "[", "alias", "cd", "command", "echo", "eval", "exec", "exit", "export", "false",
        "getopts", "kill", "local", "printf", "pwd", "read", "return", "set", "shift", "test", "trap",
        "true", "type", "ulimit", "umask", "unset", "wait",
    ];
    let separated = script
        .replace("$(", "\n")
        .replace([';', '|', '&', '(', ')', '`'], "\n");
    let mut commands = Vec::new();
    for segment in separated.lines() {
        let first = segment
            .split_whitespace()
            .find(|w| !KEYWORDS.contains(w) && !(w.contains('=') && !w.starts_with('=')));
        let Some(word) = first else { continue };
        let plain = word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_./-[".contains(c));
        if plain && !word.starts_with('-') && !BUILTINS.contains(&word) && !commands.iter().any(|c| c == word)
        {
            commands.push(word.to_string());
        }
    }
    commands
}

/// Whether `command` (an absolute path or a name looked up in PATH) is one of `tools`.
fn has_tool(tools: &[&str], command: &str) -> bool {
    tools.iter().any(|t| {
        if command.starts_with('/') {
            *t == command
        } else {
            Path::new(t).file_name().is_some_and(|n| n == command)
        }
    })
}

#[cfg(test)]
mod tests;
