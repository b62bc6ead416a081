//! Protocol buffer text format, read without a schema: the `.pbtxt` label maps and the
//! `pipeline.config` files of the TF Object Detection API. A message is a list of fields in
//! file order; a field is `name: scalar`, `name { ... }` / `name: { ... }` (also with `< >`),
//! or `name: [a, b]` (one field per element). `#` starts a comment; `,` and `;` separate
//! fields optionally. Schema-aware crates need the message definitions compiled in; the
//! readers here check the fields they know and name the ones they do not.

/// A scalar as written: its text and how it was written.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar {
    /// A quoted string, unescaped.
    Str(String),
    /// A number (`12`, `-0.5`, `1e-8`, `0x1F`, `inf`).
    Number(String),
    /// A bare word: an enum value, `true` or `false`.
    Ident(String),
}

impl Scalar {
    /// The text of the value (strings unescaped).
    pub fn text(&self) -> &str {
        match self {
            Self::Str(s) | Self::Number(s) | Self::Ident(s) => s,
        }
    }
}

/// A field's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// A scalar.
    Scalar(Scalar),
    /// A nested message.
    Message(Message),
}

/// One `name: value` of a message.
#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    /// The field name.
    pub name: String,
    /// Line of the name, from 1.
    pub line: usize,
    /// The value.
    pub value: Value,
}

/// A message: its fields in file order (repeated fields appear once per value).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Message {
    /// The fields.
    pub fields: Vec<Field>,
}

impl Message {
    /// Parses a whole text-format document. The error names the line.
    pub fn parse(text: &str) -> Result<Self, String> {
        let tokens = tokenize(text)?;
        let mut at = 0;
        let message = parse_fields(&tokens, &mut at, None, 0)?;
        Ok(message)
    }

    /// The fields called `name`, in order.
    pub fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Field> + 'a {
        self.fields.iter().filter(move |f| f.name == name)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Word(String),
    Str(String),
    Number(String),
    Open(char),
    Close(char),
    Colon,
    ListOpen,
    ListClose,
    Comma,
}

fn tokenize(text: &str) -> Result<Vec<(usize, Token)>, String> {
    let mut tokens = Vec::new();
    let mut chars = text.chars().peekable();
    let mut line = 1;
    while let Some(&c) = chars.peek() {
        match c {
            '\n' => {
                line += 1;
                chars.next();
            }
            c if c.is_whitespace() || c == ';' => {
                chars.next();
            }
            '#' => {
                while chars.peek().is_some_and(|&c| c != '\n') {
                    chars.next();
                }
            }
            '{' | '<' | '}' | '>' | ':' | '[' | ']' | ',' => {
                chars.next();
                tokens.push((
                    line,
                    match c {
                        '{' | '<' => Token::Open(c),
                        '}' | '>' => Token::Close(c),
                        ':' => Token::Colon,
                        '[' => Token::ListOpen,
                        ']' => Token::ListClose,
                        _ => Token::Comma,
                    },
                ));
            }
            '\'' | '"' => {
                chars.next();
                let mut s = String::new();
                loop {
                    match chars.next() {
                        None | Some('\n') => {
                            return Err(format!("line {line}: unterminated string"));
                        }
                        Some(q) if q == c => break,
                        Some('\\') => match chars.next() {
                            Some('n') => s.push('\n'),
                            Some('t') => s.push('\t'),
                            Some(other) => s.push(other),
                            None => return Err(format!("line {line}: unterminated string")),
                        },
                        Some(ch) => s.push(ch),
                    }
                }
                tokens.push((line, Token::Str(s)));
            }
            c if c.is_ascii_digit() || c == '-' || c == '+' || c == '.' => {
                let mut s = String::new();
                while let Some(&d) = chars.peek() {
                    let exponent_sign = (d == '-' || d == '+') && s.ends_with(['e', 'E']);
                    if d.is_ascii_alphanumeric() || d == '.' || exponent_sign || s.is_empty() {
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
                while let Some(&d) = chars.peek() {
                    if d.is_alphanumeric() || d == '_' || d == '.' {
                        s.push(d);
                        chars.next();
                    } else {
                        break;
                    }
                }
                tokens.push((line, Token::Word(s)));
            }
            other => return Err(format!("line {line}: unexpected character {other:?}")),
        }
    }
    Ok(tokens)
}

fn scalar(token: &Token) -> Option<Scalar> {
    match token {
        Token::Str(s) => Some(Scalar::Str(s.clone())),
        Token::Number(s) => Some(Scalar::Number(s.clone())),
        Token::Word(s) => Some(Scalar::Ident(s.clone())),
        _ => None,
    }
}

/// How deep messages may nest. A pipeline.config nests 7 deep; the limit keeps a hostile
/// file from overflowing the stack of the recursive parser (and of the drop of its result).
pub const MAX_DEPTH: usize = 100;

/// The message opened by `open` (`{` or `<`) on `line`, up to its closing bracket, at
/// nesting `depth` (1 for a field of the document).
fn nested(
    tokens: &[(usize, Token)],
    at: &mut usize,
    (open, line): (char, usize),
    depth: usize,
) -> Result<Value, String> {
    if depth > MAX_DEPTH {
        return Err(format!(
            "line {line}: messages nested more than {MAX_DEPTH} deep"
        ));
    }
    let closing = if open == '{' { '}' } else { '>' };
    let fields = parse_fields(tokens, at, Some((closing, line)), depth)?;
    Ok(Value::Message(fields))
}

/// Fields until `close` (or the end of the document when `close` is `None`), the message
/// being at nesting `depth`.
fn parse_fields(
    tokens: &[(usize, Token)],
    at: &mut usize,
    close: Option<(char, usize)>,
    depth: usize,
) -> Result<Message, String> {
    let mut message = Message::default();
    loop {
        let Some((line, token)) = tokens.get(*at) else {
            return match close {
                None => Ok(message),
                Some((_, opened)) => Err(format!("line {opened}: `{{` never closed")),
            };
        };
        let line = *line;
        *at += 1;
        let name = match token {
            Token::Close(c) => match close {
                Some((expected, _)) if *c == expected => return Ok(message),
                _ => return Err(format!("line {line}: unexpected `{c}`")),
            },
            Token::Comma => continue,
            Token::Word(name) => name.clone(),
            other => {
                return Err(format!(
                    "line {line}: expected a field name, found {other:?}"
                ));
            }
        };
        let colon = tokens.get(*at).is_some_and(|t| t.1 == Token::Colon);
        if colon {
            *at += 1;
        }
        let mut values = Vec::new();
        match tokens.get(*at).map(|t| &t.1) {
            Some(Token::Open(c)) => {
                *at += 1;
                values.push(nested(tokens, at, (*c, line), depth + 1)?);
            }
            Some(Token::ListOpen) if colon => {
                *at += 1;
                loop {
                    match tokens.get(*at).map(|t| &t.1) {
                        Some(Token::ListClose) => {
                            *at += 1;
                            break;
                        }
                        Some(Token::Comma) => *at += 1,
                        Some(Token::Open(c)) => {
                            *at += 1;
                            values.push(nested(tokens, at, (*c, line), depth + 1)?);
                        }
                        Some(t) => {
                            let v = scalar(t)
                                .ok_or_else(|| format!("line {line}: bad list element {t:?}"))?;
                            values.push(Value::Scalar(v));
                            *at += 1;
                        }
                        None => return Err(format!("line {line}: `[` never closed")),
                    }
                }
            }
            Some(t) if colon => {
                let v = scalar(t).ok_or_else(|| format!("line {line}: `{name}` has no value"))?;
                values.push(Value::Scalar(v));
                *at += 1;
            }
            _ => return Err(format!("line {line}: `{name}` has no value")),
        }
        message.fields.extend(values.into_iter().map(|value| Field {
            name: name.clone(),
            line,
            value,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scalar_of<'a>(m: &'a Message, name: &'a str) -> Vec<&'a str> {
        m.all(name)
            .map(|f| match &f.value {
                Value::Scalar(s) => s.text(),
                Value::Message(_) => "<message>",
            })
            .collect()
    }

    /// `depth` messages nested, one per line, in `a { ... }` (and, in lists, `a: [{ ... }]`).
    fn nesting(depth: usize, in_lists: bool) -> String {
        let (open, close) = if in_lists {
            ("a: [{\n", "}]")
        } else {
            ("a {\n", "}")
        };
        open.repeat(depth) + &close.repeat(depth)
    }

    #[test]
    fn deep_nesting_is_an_error_naming_its_line_not_a_stack_overflow() {
        for in_lists in [false, true] {
            assert!(Message::parse(&nesting(MAX_DEPTH, in_lists)).is_ok());
            let too_deep = MAX_DEPTH + 1;
            let err = Message::parse(&nesting(too_deep, in_lists)).unwrap_err();
            let want = format!("line {too_deep}: messages nested more than {MAX_DEPTH} deep");
            assert_eq!(err, want);
            // far deeper than a stack can take unchecked
            assert!(Message::parse(&nesting(1_000_000, in_lists)).is_err());
        }
    }

    #[test]
    fn parses_nesting_lists_comments_and_all_separators() {
        let text = "# header\nmodel {\n  ssd: { num_classes: 37, x: 1e-8; y: -2.5E+3 }\n}\n\
                    name: 'a\\'b' other: \"c\"\nratios: [1.0, 2, 0.5]\nratios: 3.0\n\
                    item < id: 1 > item { id: 2 }\nenum_value: SIGMOID\nempty {}\n";
        let m = Message::parse(text).unwrap();
        let Value::Message(model) = &m.fields[0].value else {
            panic!("model is a message")
        };
        let Value::Message(ssd) = &model.fields[0].value else {
            panic!("ssd is a message")
        };
        assert_eq!(ssd.fields[0].line, 3);
        assert_eq!(scalar_of(ssd, "num_classes"), ["37"]);
        assert_eq!(scalar_of(ssd, "x"), ["1e-8"]);
        assert_eq!(scalar_of(ssd, "y"), ["-2.5E+3"]);
        assert_eq!(scalar_of(&m, "name"), ["a'b"]);
        assert_eq!(scalar_of(&m, "ratios"), ["1.0", "2", "0.5", "3.0"]);
        assert_eq!(m.all("item").count(), 2);
        assert_eq!(
            m.all("enum_value").next().unwrap().value,
            Value::Scalar(Scalar::Ident("SIGMOID".into()))
        );
        assert_eq!(
            m.all("empty").next().unwrap().value,
            Value::Message(Message::default())
        );
    }

    #[test]
    fn errors_name_the_line() {
        for (text, line) in [
            ("a {\n b: 1\n", "line 1"),
            ("a: 1\n}\n", "line 2"),
            ("a: 'x\n", "line 1"),
            ("a: 1\nb\n", "line 2"),
            ("a: 1\n\n c: [1, 2\n", "line 3"),
            ("a: 1\n$\n", "line 2"),
            ("a { b: 1 >\n", "line 1"),
        ] {
            let e = Message::parse(text).unwrap_err();
            assert!(e.starts_with(line), "{text:?}: {e}");
        }
    }
}
