//! Label maps in the Object Detection API's protobuf text format:
//! `item { id: 1 name: 'cat' display_name: "Cat" }`, with `#` comments.

use std::path::Path;

use crate::error::{DataError, Result};

/// One class of a label map.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelMapItem {
    /// Class id (1-based; 0 is the background).
    pub id: i64,
    /// Class name (`name`).
    pub name: String,
    /// Optional human-readable name (`display_name`).
    pub display_name: Option<String>,
}

/// A label map: classes by id.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LabelMap {
    /// The items, sorted by id.
    pub items: Vec<LabelMapItem>,
}

#[derive(Debug, PartialEq)]
enum Token {
    Ident(String),
    Str(String),
    Number(String),
    Open,
    Close,
    Colon,
}

fn tokenize(text: &str) -> std::result::Result<Vec<(usize, Token)>, String> {
    let mut tokens = Vec::new();
    let mut chars = text.char_indices().peekable();
    let mut line = 1;
    while let Some(&(_, c)) = chars.peek() {
        match c {
            '\n' => {
                line += 1;
                chars.next();
            }
            c if c.is_whitespace() || c == ',' || c == ';' => {
                chars.next();
            }
            '#' => {
                while chars.peek().is_some_and(|&(_, c)| c != '\n') {
                    chars.next();
                }
            }
            '{' | '<' => {
                chars.next();
                tokens.push((line, Token::Open));
            }
            '}' | '>' => {
                chars.next();
                tokens.push((line, Token::Close));
            }
            ':' => {
                chars.next();
                tokens.push((line, Token::Colon));
            }
            '\'' | '"' => {
                chars.next();
                let mut s = String::new();
                loop {
                    match chars.next() {
                        None | Some((_, '\n')) => {
                            return Err(format!("line {line}: unterminated string"));
                        }
                        Some((_, q)) if q == c => break,
                        Some((_, '\\')) => match chars.next() {
                            Some((_, 'n')) => s.push('\n'),
                            Some((_, 't')) => s.push('\t'),
                            Some((_, other)) => s.push(other),
                            None => return Err(format!("line {line}: unterminated string")),
                        },
                        Some((_, ch)) => s.push(ch),
                    }
                }
                tokens.push((line, Token::Str(s)));
            }
            c if c.is_ascii_digit() || c == '-' || c == '+' || c == '.' => {
                let mut s = String::new();
                while let Some(&(_, d)) = chars.peek() {
                    if d.is_ascii_alphanumeric() || d == '.' || d == '-' || d == '+' {
                        s.push(d);
                        chars.next();
                    } else {
                        break;
                    }
                }
                tokens.push((line, Token::Number(s)));
            }
            c if c.is_alphabetic() || c == '_' => {
                let mut s = String::new();
                while let Some(&(_, d)) = chars.peek() {
                    if d.is_alphanumeric() || d == '_' || d == '.' {
                        s.push(d);
                        chars.next();
                    } else {
                        break;
                    }
                }
                tokens.push((line, Token::Ident(s)));
            }
            other => return Err(format!("line {line}: unexpected character {other:?}")),
        }
    }
    Ok(tokens)
}

/// Skips one value (scalar or nested message) after a field name.
fn skip_value(tokens: &[(usize, Token)], mut i: usize) -> usize {
    if tokens.get(i).is_some_and(|t| t.1 == Token::Colon) {
        i += 1;
    }
    if tokens.get(i).is_some_and(|t| t.1 == Token::Open) {
        let mut depth = 0;
        while let Some((_, t)) = tokens.get(i) {
            match t {
                Token::Open => depth += 1,
                Token::Close => {
                    depth -= 1;
                    if depth == 0 {
                        return i + 1;
                    }
                }
                _ => {}
            }
            i += 1;
        }
        i
    } else {
        i + 1
    }
}

impl LabelMap {
    /// Parses label-map text. Fields other than `id`, `name` and `display_name` are skipped.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let tokens = tokenize(text)?;
        let mut items = Vec::new();
        let mut i = 0;
        while i < tokens.len() {
            let (line, ref t) = tokens[i];
            match t {
                Token::Ident(name) if name == "item" => {}
                other => return Err(format!("line {line}: expected `item`, found {other:?}")),
            }
            i += 1;
            if tokens.get(i).is_some_and(|t| t.1 == Token::Colon) {
                i += 1;
            }
            if tokens.get(i).map(|t| &t.1) != Some(&Token::Open) {
                return Err(format!("line {line}: expected `{{` after `item`"));
            }
            i += 1;
            let (mut id, mut name, mut display_name) = (None, None, None);
            loop {
                let Some((line, t)) = tokens.get(i) else {
                    return Err(format!("line {line}: unclosed `item`"));
                };
                match t {
                    Token::Close => {
                        i += 1;
                        break;
                    }
                    Token::Ident(field) => {
                        let value = match (tokens.get(i + 1), tokens.get(i + 2)) {
                            (Some((_, Token::Colon)), Some((_, v))) => Some(v),
                            _ => None,
                        };
                        match (field.as_str(), value) {
                            ("id", Some(Token::Number(n))) => {
                                id = Some(
                                    n.parse::<i64>()
                                        .map_err(|_| format!("line {line}: bad id {n:?}"))?,
                                );
                                i += 3;
                            }
                            ("name", Some(Token::Str(s))) => {
                                name = Some(s.clone());
                                i += 3;
                            }
                            ("display_name", Some(Token::Str(s))) => {
                                display_name = Some(s.clone());
                                i += 3;
                            }
                            ("id" | "name" | "display_name", _) => {
                                return Err(format!("line {line}: bad value for `{field}`"));
                            }
                            _ => i = skip_value(&tokens, i + 1),
                        }
                    }
                    other => return Err(format!("line {line}: unexpected {other:?} in `item`")),
                }
            }
            let id = id.ok_or_else(|| format!("line {line}: item without `id`"))?;
            if id < 1 {
                return Err(format!(
                    "line {line}: id {id} must be at least 1 (0 is the background)"
                ));
            }
            let name = name
                .or_else(|| display_name.clone())
                .ok_or_else(|| format!("line {line}: item without `name`"))?;
            items.push(LabelMapItem {
                id,
                name,
                display_name,
            });
        }
        items.sort_by_key(|it| it.id);
        if let Some(w) = items.windows(2).find(|w| w[0].id == w[1].id) {
            return Err(format!("id {} appears twice", w[0].id));
        }
        Ok(Self { items })
    }

    /// Reads and parses a `.pbtxt` file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(DataError::io("reading", path))?;
        Self::parse(&text).map_err(|problem| DataError::invalid(path, problem))
    }

    /// Label-map text for these items.
    pub fn to_pbtxt(&self) -> String {
        let mut out = String::new();
        for it in &self.items {
            out.push_str(&format!(
                "item {{\n  id: {}\n  name: '{}'\n",
                it.id,
                it.name.replace('\'', "\\'")
            ));
            if let Some(d) = &it.display_name {
                out.push_str(&format!("  display_name: '{}'\n", d.replace('\'', "\\'")));
            }
            out.push_str("}\n\n");
        }
        out
    }

    /// A label map with ids 1.. for the given names.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Self {
        Self {
            items: names
                .iter()
                .enumerate()
                .map(|(i, n)| LabelMapItem {
                    id: i as i64 + 1,
                    name: n.as_ref().to_string(),
                    display_name: None,
                })
                .collect(),
        }
    }

    /// The id of the class called `name`.
    pub fn id_of(&self, name: &str) -> Option<i64> {
        self.items.iter().find(|it| it.name == name).map(|it| it.id)
    }

    /// Class names in id order (for `SsdConfig::class_names`).
    pub fn names(&self) -> Vec<String> {
        self.items.iter().map(|it| it.name.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_comments_quotes_and_display_names() {
        let text = r#"
# Oxford pets, two of them
item {
  id: 2
  name: "dog"   # trailing comment
  display_name: 'Dog \'friend\''
}
item { id: 1 name: 'cat' frequency: FREQUENT keypoints { id: 0 label: "nose" } }
"#;
        let map = LabelMap::parse(text).unwrap();
        assert_eq!(map.names(), vec!["cat", "dog"]);
        assert_eq!(map.items[1].display_name.as_deref(), Some("Dog 'friend'"));
        assert_eq!(map.id_of("dog"), Some(2));
        assert_eq!(LabelMap::parse(&map.to_pbtxt()).unwrap(), map);
    }

    #[test]
    fn errors_name_the_line() {
        for (text, want) in [
            ("item { id: 1 name: 'a }", "line 1"),
            ("item { name: 'a' }", "without `id`"),
            ("item {\n id: 0 name: 'a' }", "at least 1"),
            ("thing { }", "expected `item`"),
            ("item { id: 1 name: 'a' } item { id: 1 name: 'b' }", "twice"),
        ] {
            let err = LabelMap::parse(text).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
    }
}
