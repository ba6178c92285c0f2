//! The lb-agent recipe against manifests/Dockerfile, and the DaemonSet's commands against the
//! image's tools.

use std::fs;

use serde_json::Value;

use super::*;
use crate::{image::recipes::agent_recipe, util::workspace_root};

fn dockerfile() -> String {
    fs::read_to_string(workspace_root().join("manifests/Dockerfile")).unwrap()
}

#[test]
fn agent_recipe_matches_the_dockerfile_runtime_stage() {
    let problems = dockerfile_disagreements(&dockerfile(), &agent_recipe());
    assert!(
        problems.is_empty(),
        "the lb-agent image recipe (xtask/src/image/recipes.rs) and manifests/Dockerfile disagree:\n{}",
        problems.join("\n")
    );
}

#[test]
fn a_drifted_dockerfile_is_caught_with_its_line() {
    let original = dockerfile();
    let drifted = original
        .replace(
            "ENTRYPOINT [\"/usr/local/bin/lb-agent\"]",
            "ENTRYPOINT [\"/usr/bin/lb-agent\"]",
        )
        .replace("FROM debian:bookworm-slim", "FROM debian:trixie-slim");
    assert_ne!(drifted, original, "the test's replacements no longer apply");
    let problems = dockerfile_disagreements(&drifted, &agent_recipe());
    let line_of = |needle: &str| drifted.lines().position(|l| l.contains(needle)).unwrap() + 1;
    for (needle, keyword) in [("/usr/bin/lb-agent", "ENTRYPOINT"), ("trixie", "FROM")] {
        let expected = format!("manifests/Dockerfile:{}: `{keyword} ", line_of(needle));
        assert!(
            problems.iter().any(|p| p.starts_with(&expected)),
            "{expected} in {problems:#?}"
        );
    }
    let extra = format!("{original}RUN apt-get install -y curl\n");
    let problems = dockerfile_disagreements(&extra, &agent_recipe());
    assert!(
        problems
            .iter()
            .any(|p| p.contains("`RUN apt-get") && p.contains("not modelled")),
        "{problems:#?}"
    );
}

#[test]
fn dockerfile_continuations_and_comments() {
    let text = "FROM a AS b\nRUN x \\\n # note\n  && y\n\nFROM debian:bookworm-slim\nUSER 0\n";
    let parsed = dockerfile_instructions(text);
    let summary: Vec<(usize, &str, &str)> = parsed
        .iter()
        .map(|i| (i.line, i.keyword.as_str(), i.rest.as_str()))
        .collect();
    assert_eq!(
        summary,
        [
            (1, "FROM", "a AS b"),
            (2, "RUN", "x && y"),
            (6, "FROM", "debian:bookworm-slim"),
            (7, "USER", "0")
        ]
    );
}

#[test]
fn daemonset_init_commands_are_in_the_agent_image() {
    let path = workspace_root().join("manifests/daemonset.yaml");
    let doc: Value = serde_saphyr::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    let spec = &doc["spec"]["template"]["spec"];
    let inits = spec["initContainers"].as_array().expect("initContainers");
    assert!(!inits.is_empty());
    let tools = agent_recipe().tools;
    let mut checked = Vec::new();
    for container in inits.iter().chain(spec["containers"].as_array().unwrap()) {
        let name = container["name"].as_str().unwrap_or_default();
        let image = container["image"].as_str().unwrap_or_default();
        assert!(
            image.contains("lb-agent"),
            "{name} runs {image}, not the lb-agent image"
        );
        let words = |key: &str| -> Vec<String> {
            container[key]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
                .unwrap_or_default()
        };
        let (command, args) = (words("command"), words("args"));
        let Some(program) = command.first() else {
            continue; // the image's entrypoint: lb-agent
        };
        assert!(
            has_tool(tools, program),
            "{name} runs {program}, which the image lacks ({tools:?})"
        );
        checked.push(program.clone());
        let argv: Vec<&String> = command.iter().chain(&args).collect();
        if let Some(c) = argv.iter().position(|w| *w == "-c") {
            let script = argv.get(c + 1).expect("a script after -c");
            let commands = script_commands(script);
            assert!(!commands.is_empty(), "no command found in {script:?}");
            for command in commands {
                assert!(
                    has_tool(tools, &command),
                    "{name}'s script runs `{command}`, which the lb-agent image lacks: add it to AGENT_TOOLS \
                     (tools: {tools:?})"
                );
                checked.push(command);
            }
        }
    }
    for needed in ["/bin/sh", "stat", "mount"] {
        assert!(
            checked.iter().any(|c| c == needed),
            "{needed} not found in {checked:?}"
        );
    }
}

#[test]
fn script_commands_skip_keywords_and_builtins() {
    let script = "set -eu\nif [ \"$(stat -f -c %T /x)\" = bpf_fs ]; then\n  echo ok\nelse\n  \
                  mount -t bpf bpf /x && X=1 cat /y | grep z\nfi\n";
    assert_eq!(script_commands(script), ["stat", "mount", "cat", "grep"]);
}
