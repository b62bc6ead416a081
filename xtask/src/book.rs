//! `cargo xtask check-book`: the guide (`docs/src`) and README.md checked against the files
//! and the program they describe. Every chapter in `SUMMARY.md` exists and every chapter is
//! in it; every relative link leads to a file, and every `#anchor` to a heading there; every
//! `train` and `cargo xtask` command in a shell block names a subcommand and flags that the
//! built binaries' `--help` lists; every `{{#include FILE}}` names a file that exists; and
//! README's copies of generated files (the figures of `cargo xtask figures`, between marker
//! comments) equal the files. So the guide cannot drift from the program unnoticed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Checks the guide and README.md under `root` against the `train` and `xtask` binaries in
/// `bin_dir`; prints every problem and fails when there is one.
pub fn check(root: &Path, bin_dir: &Path) -> Result<()> {
    let pages = pages(root)?;
    let mut problems = summary_problems(root, &pages)?;
    problems.extend(generated_problems(root)?);
    let mut help = Help::new(bin_dir);
    for (path, text) in &pages {
        let name = path
            .strip_prefix(root)
            .unwrap_or(path)
            .display()
            .to_string();
        for problem in link_problems(path, text, &pages)
            .into_iter()
            .chain(include_problems(path, text))
        {
            problems.push(format!("{name}: {problem}"));
        }
        for (line, command) in commands(text) {
            for problem in help.problems(&command)? {
                problems.push(format!("{name}:{line}: `{}`: {problem}", command.shown()));
            }
        }
    }
    for problem in &problems {
        eprintln!("{problem}");
    }
    if !problems.is_empty() {
        bail!("{} problems in the guide", problems.len());
    }
    println!(
        "guide checked: {} pages, {} commands",
        pages.len(),
        help.checked
    );
    Ok(())
}

/// README.md and every Markdown file of `docs/src`, by path.
fn pages(root: &Path) -> Result<BTreeMap<PathBuf, String>> {
    let mut paths = vec![root.join("README.md")];
    let src = root.join("docs/src");
    for entry in std::fs::read_dir(&src).with_context(|| format!("reading {}", src.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "md") {
            paths.push(path);
        }
    }
    paths
        .into_iter()
        .map(|p| {
            let text =
                std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()));
            text.map(|t| (normal(&p), t))
        })
        .collect()
}

/// `path` without `.` and `..` components (the pages are looked up by it).
fn normal(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Chapters that `SUMMARY.md` names but that do not exist, and chapters it leaves out.
fn summary_problems(root: &Path, pages: &BTreeMap<PathBuf, String>) -> Result<Vec<String>> {
    let src = root.join("docs/src");
    let summary = pages
        .get(&normal(&src.join("SUMMARY.md")))
        .context("docs/src/SUMMARY.md is missing")?;
    let listed: BTreeSet<PathBuf> = links(summary)
        .map(|(target, _)| normal(&src.join(target)))
        .collect();
    let mut problems = Vec::new();
    for chapter in &listed {
        if !pages.contains_key(chapter) {
            problems.push(format!(
                "SUMMARY.md names {}, which does not exist",
                chapter.display()
            ));
        }
    }
    for page in pages.keys().filter(|p| p.starts_with(normal(&src))) {
        if !listed.contains(page) && !page.ends_with("SUMMARY.md") {
            problems.push(format!("{} is not in SUMMARY.md", page.display()));
        }
    }
    Ok(problems)
}

/// The text of `markdown` outside fenced code blocks and inline code, line by line.
fn prose(markdown: &str) -> impl Iterator<Item = String> + '_ {
    let mut fenced = false;
    markdown.lines().filter_map(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return None;
        }
        (!fenced).then(|| line.split('`').step_by(2).collect::<Vec<_>>().join(" "))
    })
}

/// The relative links of `markdown`: `(path, anchor)`, either of them possibly empty.
fn links(markdown: &str) -> impl Iterator<Item = (String, String)> + '_ {
    prose(markdown)
        .flat_map(|line| {
            line.match_indices("](")
                .filter_map(|(at, _)| {
                    let rest = &line[at + 2..];
                    rest.find(')').map(|end| rest[..end].to_string())
                })
                .collect::<Vec<_>>()
        })
        .filter(|target| !target.contains("://") && !target.starts_with("mailto:"))
        .map(|target| match target.split_once('#') {
            Some((path, anchor)) => (path.to_string(), anchor.to_string()),
            None => (target, String::new()),
        })
}

/// Links of the page at `path` whose file or heading does not exist.
fn link_problems(path: &Path, text: &str, pages: &BTreeMap<PathBuf, String>) -> Vec<String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut problems = Vec::new();
    for (target, anchor) in links(text) {
        let file = if target.is_empty() {
            path.to_path_buf()
        } else {
            normal(&dir.join(&target))
        };
        if !file.exists() {
            problems.push(format!("link to {target}, which does not exist"));
        } else if !anchor.is_empty() {
            let headings = pages.get(&file).map(|t| anchors(t)).unwrap_or_default();
            if !headings.contains(&anchor) {
                problems.push(format!("link to {target}#{anchor}: no such heading there"));
            }
        }
    }
    problems
}

/// `{{#include FILE}}` directives of the page at `path` whose file does not exist (mdBook
/// resolves them from the page's folder; a `:anchor` or line range after the name is left
/// out).
fn include_problems(path: &Path, text: &str) -> Vec<String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    text.match_indices("{{#include ")
        .filter_map(|(at, directive)| {
            let rest = &text[at + directive.len()..];
            let target = rest[..rest.find("}}")?].trim();
            let file = target.split(':').next().unwrap_or(target);
            (!dir.join(file).is_file()).then(|| format!("includes {file}, which does not exist"))
        })
        .collect()
}

/// README's copies of generated files that differ from the files (or name a file that does
/// not exist): regenerate with `cargo xtask figures`, which writes both.
fn generated_problems(root: &Path) -> Result<Vec<String>> {
    let path = root.join("README.md");
    let readme =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut problems = Vec::new();
    for (name, copy, line) in crate::figures::readme_blocks(&readme)? {
        let file = root.join(&name);
        match std::fs::read_to_string(&file) {
            Ok(text) if text.trim_end() == copy.trim_end() => {}
            Ok(_) => problems.push(format!(
                "README.md:{line}: the copy of {name} differs from the file (run `cargo xtask figures`, which writes both)"
            )),
            Err(e) => problems.push(format!("README.md:{line}: reading {name}: {e}")),
        }
    }
    Ok(problems)
}

/// The anchors of a page's headings, as mdBook and GitHub make them: lower case, spaces to
/// `-`, other punctuation than `-` and `_` dropped; a repeated heading gets `-1`, `-2`, ...
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen = BTreeMap::<String, usize>::new();
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        let Some(title) = line.strip_prefix('#').filter(|_| !fenced) else {
            continue;
        };
        let title = title.trim_start_matches('#').trim().replace('`', "");
        let slug: String = title
            .chars()
            .filter_map(|c| match c {
                c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c.to_ascii_lowercase()),
                c if c.is_whitespace() => Some('-'),
                _ => None,
            })
            .collect();
        let n = seen.entry(slug.clone()).or_default();
        out.insert(if *n == 0 {
            slug.clone()
        } else {
            format!("{slug}-{n}")
        });
        *n += 1;
    }
    out
}

/// A program of this project in a shell command: which, and its arguments.
#[derive(Debug, PartialEq)]
struct Invocation {
    program: &'static str,
    args: Vec<String>,
}

impl Invocation {
    /// The command as the guide has it, for messages.
    fn shown(&self) -> String {
        format!("{} {}", self.program, self.args.join(" "))
    }

    /// The subcommand (the first argument, where it is not a flag) and the `--flags`.
    fn parts(&self) -> (Option<&str>, Vec<String>) {
        let sub = self
            .args
            .first()
            .map(|a| a.as_str())
            .filter(|a| !a.starts_with('-') && !a.starts_with('['));
        let flags = self
            .args
            .iter()
            .map(|a| a.trim_start_matches(['[', '(', '"', '\'']))
            .filter(|a| a.starts_with("--") && a.len() > 2)
            .map(|a| {
                let name = a.split('=').next().unwrap_or(a);
                name.trim_end_matches([']', ')', ',', '.', '"', '\''])
                    .to_string()
            })
            .collect();
        (sub, flags)
    }
}

/// Words that start another program and hand the rest of the line to ours.
const LAUNCHERS: [&str; 8] = [
    "mpirun", "mpiexec", "srun", "time", "nice", "timeout", "env", "exec",
];

/// The invocations of `train` and `cargo xtask` in the shell blocks of `markdown`, with the
/// line each starts on (lines continued by `\` joined).
fn commands(markdown: &str) -> Vec<(usize, Invocation)> {
    let mut out = Vec::new();
    let mut block: Option<bool> = None; // Some(is_shell) inside a fence
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            block = match block {
                None => Some(matches!(
                    info.trim(),
                    "" | "sh" | "bash" | "shell" | "console"
                )),
                Some(_) => None,
            };
            continue;
        }
        if block != Some(true) {
            continue;
        }
        let (start, mut text) = pending.take().unwrap_or((i + 1, String::new()));
        let code = trimmed.split(" #").next().unwrap_or(trimmed);
        if code.starts_with('#') {
            continue;
        }
        text.push_str(code.trim_end_matches('\\'));
        text.push(' ');
        if code.ends_with('\\') {
            pending = Some((start, text));
        } else {
            out.extend(invocations(&text).into_iter().map(|inv| (start, inv)));
        }
    }
    out
}

/// The invocations in one logical shell line: each segment between `&&`, `;`, `||` and
/// pipes outside brackets (usage lines write alternatives as `[a | b]`).
fn invocations(line: &str) -> Vec<Invocation> {
    let mut segments = vec![Vec::new()];
    let mut depth = 0i32;
    for token in shell_words(line) {
        let token = token.as_str();
        depth += token.matches('[').count() as i32 - token.matches(']').count() as i32;
        let ends = matches!(token, "&&" | ";" | "||") || (token == "|" && depth <= 0);
        if ends {
            segments.push(Vec::new());
        } else if let Some(last) = segments.last_mut() {
            last.push(token.trim_end_matches(';').to_string());
        }
    }
    segments.iter().filter_map(|s| invocation(s)).collect()
}

/// `line` split at white space outside quotes, the quotes removed (`--only "a --b"` is one
/// flag and one value).
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quote) = (Vec::new(), String::new(), None);
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '"' | '\'') => quote = Some(c),
            (None, c) if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            (_, c) => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

/// The program of ours that `tokens` (one command) runs, if any.
fn invocation(tokens: &[String]) -> Option<Invocation> {
    let bare = |t: &String| t.trim_matches(['"', '\'', '(', ')']).to_string();
    let tokens: Vec<String> = tokens
        .iter()
        .map(bare)
        .skip_while(|t| t.contains('=') && !t.starts_with('-'))
        .collect();
    let first = tokens.first()?;
    let ours = |t: &str| match t.rsplit('/').next() {
        Some("train") => Some("train"),
        Some("xtask") => Some("xtask"),
        _ => None,
    };
    if first == "cargo" {
        return cargo_invocation(&tokens[1..]);
    }
    let at = if LAUNCHERS.contains(&first.as_str()) {
        tokens.iter().position(|t| ours(t).is_some())?
    } else {
        0
    };
    let program = ours(&tokens[at])?;
    Some(Invocation {
        program,
        args: tokens[at + 1..].to_vec(),
    })
}

/// `cargo xtask ARGS` and `cargo run ... -p train [-- ARGS]`.
fn cargo_invocation(tokens: &[String]) -> Option<Invocation> {
    match tokens.first()?.as_str() {
        "xtask" => Some(Invocation {
            program: "xtask",
            args: tokens[1..].to_vec(),
        }),
        "run" => {
            let package = tokens
                .windows(2)
                .find(|w| w[0] == "-p" || w[0] == "--package")
                .map(|w| w[1].as_str());
            if package != Some("train") {
                return None;
            }
            let args = match tokens.iter().position(|t| t == "--") {
                Some(at) => tokens[at + 1..].to_vec(),
                None => Vec::new(),
            };
            Some(Invocation {
                program: "train",
                args,
            })
        }
        _ => None,
    }
}

/// The binaries' `--help` texts, asked once each.
struct Help {
    bin_dir: PathBuf,
    texts: BTreeMap<(String, String), String>,
    checked: usize,
}

impl Help {
    fn new(bin_dir: &Path) -> Self {
        Self {
            bin_dir: bin_dir.to_path_buf(),
            texts: BTreeMap::new(),
            checked: 0,
        }
    }

    /// `program [sub] --help`.
    fn text(&mut self, program: &str, sub: &str) -> Result<&str> {
        let key = (program.to_string(), sub.to_string());
        if !self.texts.contains_key(&key) {
            let binary = self.bin_dir.join(program);
            let mut command = Command::new(&binary);
            if !sub.is_empty() {
                command.arg(sub);
            }
            let out = command.arg("--help").output().with_context(|| {
                format!(
                    "running {} (build it first: cargo build --release --workspace)",
                    binary.display()
                )
            })?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            self.texts.insert(
                key.clone(),
                if out.status.success() {
                    text
                } else {
                    String::new()
                },
            );
        }
        Ok(&self.texts[&key])
    }

    /// What is wrong with `inv`: a subcommand the program does not have, flags it does not take.
    fn problems(&mut self, inv: &Invocation) -> Result<Vec<String>> {
        self.checked += 1;
        let (sub, flags) = inv.parts();
        let sub = sub.unwrap_or("");
        let program = inv.program;
        let text = self.text(program, sub)?.to_string();
        if text.is_empty() {
            return Ok(vec![format!("{program} has no subcommand {sub:?}")]);
        }
        Ok(flags
            .into_iter()
            .filter(|f| !has_flag(&text, f))
            .map(|f| {
                format!(
                    "`{}` lists no {f}",
                    [program, sub, "--help"].join(" ").replace("  ", " ")
                )
            })
            .collect())
    }
}

/// Whether a `--help` text lists `flag` (followed by a space, a value, a comma or the line's end).
fn has_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(at, _)| {
        let next = help[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv(program: &'static str, args: &[&str]) -> Invocation {
        Invocation {
            program,
            args: args.iter().map(|a| a.to_string()).collect(),
        }
    }

    #[test]
    fn commands_are_found_in_shell_blocks_with_their_flags() {
        let page = "text `train --nope`\n\n```sh\n\
            cargo run --release -p train -- eval --model-dir runs/x   # a comment --not-this\n\
            FOO=1 mpirun -np 2 target/release/train --devices cpu \\\n  --config c.json && cargo xtask bench --only 'x'\n\
            cargo xtask bench --only \"train --devices cpu\" --repeats 8\n\
            cargo run --release -p model --example anchors -- --config x\n\
            # train --commented\n\
            ```\n\n```\ncargo run --release -p train -- [--devices 0,1 | cpu] [--seed S]\n```\n\
            ```json\n{\"train\": 1}\n```\n";
        let all = commands(page);
        // a quoted value is one argument, whatever it holds
        assert_eq!(all[3].1.parts().1, ["--only", "--repeats"]);
        let found: Vec<_> = all.into_iter().map(|(l, i)| (l, i.shown())).collect();
        assert_eq!(
            found,
            [
                (4, "train eval --model-dir runs/x".to_string()),
                (5, "train --devices cpu --config c.json".to_string()),
                (5, "xtask bench --only x".to_string()),
                (
                    7,
                    "xtask bench --only train --devices cpu --repeats 8".to_string()
                ),
                (13, "train [--devices 0,1 | cpu] [--seed S]".to_string()),
            ]
        );
        let usage = inv(
            "train",
            &["[--devices", "0,1", "|", "cpu]", "[--seed", "S]"],
        );
        assert_eq!(
            usage.parts(),
            (None, vec!["--devices".to_string(), "--seed".to_string()])
        );
        let eval = inv("train", &["eval", "--data='a*'", "--out"]);
        assert_eq!(
            eval.parts(),
            (
                Some("eval"),
                vec!["--data".to_string(), "--out".to_string()]
            )
        );
    }

    #[test]
    fn flags_match_whole_names_only() {
        let help = "  --model-dir <MODEL_DIR>\n  --no-eval\n  --out, -o\n";
        assert!(
            has_flag(help, "--model-dir") && has_flag(help, "--no-eval") && has_flag(help, "--out")
        );
        assert!(!has_flag(help, "--model") && !has_flag(help, "--no") && !has_flag(help, "--eval"));
    }

    #[test]
    fn readme_copies_of_generated_files_must_equal_them() {
        let dir = tempfile::tempdir().expect("temp dir");
        let name = "docs/src/figures/run.md";
        std::fs::create_dir_all(dir.path().join("docs/src/figures")).expect("mkdir");
        std::fs::write(dir.path().join(name), "| a | 1 |\n").expect("write");
        let readme = |body: &str| {
            let text = format!(
                "# R\n\n{}\n{body}{}\n",
                crate::figures::begin_marker(name),
                crate::figures::end_marker(name)
            );
            std::fs::write(dir.path().join("README.md"), text).expect("write");
        };
        readme("| a | 1 |\n");
        assert!(generated_problems(dir.path()).expect("check").is_empty());
        readme("| a | 2 |\n");
        let problems = generated_problems(dir.path()).expect("check");
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].starts_with("README.md:3: the copy of docs/src/figures/run.md differs"),
            "{problems:?}"
        );
        std::fs::remove_file(dir.path().join(name)).expect("remove");
        readme("| a | 1 |\n");
        assert!(generated_problems(dir.path()).expect("check")[0].contains("reading"));
    }

    #[test]
    fn includes_must_name_existing_files() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(dir.path().join("figures")).expect("mkdir");
        std::fs::write(dir.path().join("figures/run.md"), "x").expect("write");
        let page = dir.path().join("perf.md");
        let text = "a\n{{#include figures/run.md}}\n{{#include figures/gone.md:2:5}}\n";
        assert_eq!(
            include_problems(&page, text),
            ["includes figures/gone.md, which does not exist".to_string()]
        );
    }

    #[test]
    fn links_and_anchors_are_checked_against_the_pages() {
        let dir = tempfile::tempdir().expect("temp dir");
        let a = dir.path().join("a.md");
        let b = dir.path().join("b.md");
        let b_text = "# B page\n\n## The `pipeline.config` import (2026)\n\n```sh\n# not a heading\n```\n## Twice\n## Twice\n";
        let a_text = "[ok](b.md#the-pipelineconfig-import-2026) [twice](b.md#twice-1) [self](#top)\n\
            [web](https://x.org/y#z) [gone](c.md) [bad](b.md#not-a-heading) `[code](c.md)`\n# Top\n";
        std::fs::write(&a, a_text).expect("write");
        std::fs::write(&b, b_text).expect("write");
        let pages = BTreeMap::from([(a.clone(), a_text.to_string()), (b, b_text.to_string())]);
        assert_eq!(
            link_problems(&a, a_text, &pages),
            [
                "link to c.md, which does not exist".to_string(),
                "link to b.md#not-a-heading: no such heading there".to_string(),
            ]
        );
    }
}
