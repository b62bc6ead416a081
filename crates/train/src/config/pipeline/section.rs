//! Reading one message of a `pipeline.config`: every field read is marked, absent fields take
//! the proto's defaults, and what is left unread is reported as unsupported, with its line.

use data::textproto::{Field, Message, Scalar, Value};

/// What an import found: unsupported settings (errors) and settings ignored or still to be
/// filled in (notes).
#[derive(Default)]
pub(super) struct Report {
    pub errors: Vec<String>,
    pub notes: Vec<String>,
}

/// One message being read: the fields taken are marked; the rest are reported by `finish`.
pub(super) struct Section<'a> {
    pub message: &'a Message,
    pub path: String,
    used: Vec<bool>,
    /// The names this reader asked for, present or not: what a misspelt field was meant to be.
    asked: Vec<String>,
}

impl<'a> Section<'a> {
    pub fn new(message: &'a Message, path: impl Into<String>) -> Self {
        Self {
            message,
            path: path.into(),
            used: vec![false; message.fields.len()],
            asked: Vec::new(),
        }
    }

    /// The dotted path of field `name` of this message.
    pub fn join(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    pub fn at(&self, field: &Field) -> String {
        format!("{} (line {})", self.join(&field.name), field.line)
    }

    /// Every field called `name`, marked as read.
    pub fn take(&mut self, name: &str) -> Vec<&'a Field> {
        self.asked.push(name.to_string());
        let mut out = Vec::new();
        for (i, f) in self.message.fields.iter().enumerate() {
            if f.name == name {
                self.used[i] = true;
                out.push(f);
            }
        }
        out
    }

    /// The last scalar called `name` (protobuf text format: the last one wins).
    pub fn scalar(&mut self, name: &str, report: &mut Report) -> Option<(&'a Scalar, String)> {
        let field = self.take(name).pop()?;
        match &field.value {
            Value::Scalar(s) => Some((s, self.at(field))),
            Value::Message(_) => {
                report
                    .errors
                    .push(format!("{}: expected a value", self.at(field)));
                None
            }
        }
    }

    pub fn number<T: std::str::FromStr>(
        &mut self,
        name: &str,
        default: T,
        report: &mut Report,
    ) -> T {
        match self.scalar(name, report) {
            None => default,
            // every number this crate reads is an f32 or an integer: none is infinite
            Some((Scalar::Number(n), at))
                if n.parse::<f64>()
                    .is_ok_and(|v| v.is_nan() || v.abs() > f64::from(f32::MAX)) =>
            {
                report
                    .errors
                    .push(format!("{at}: `{n}` is not a finite number"));
                default
            }
            Some((Scalar::Number(n), at)) => n.parse().unwrap_or_else(|_| {
                report
                    .errors
                    .push(format!("{at}: `{n}` is not a valid number here"));
                default
            }),
            Some((other, at)) => {
                report
                    .errors
                    .push(format!("{at}: expected a number, found `{}`", other.text()));
                default
            }
        }
    }

    pub fn numbers(&mut self, name: &str, report: &mut Report) -> Vec<f32> {
        let fields = self.take(name);
        let mut out = Vec::new();
        for f in fields {
            match &f.value {
                Value::Scalar(Scalar::Number(n)) if n.parse::<f32>().is_ok() => {
                    out.push(n.parse().expect("checked"))
                }
                _ => report
                    .errors
                    .push(format!("{}: expected a number", self.at(f))),
            }
        }
        out
    }

    pub fn word(&mut self, name: &str, default: &str, report: &mut Report) -> String {
        match self.scalar(name, report) {
            None => default.to_string(),
            Some((s, _)) => s.text().to_string(),
        }
    }

    pub fn flag(&mut self, name: &str, default: bool, report: &mut Report) -> bool {
        match self.scalar(name, report) {
            None => default,
            Some((s, at)) => match s.text() {
                "true" | "True" | "t" | "1" => true,
                "false" | "False" | "f" | "0" => false,
                other => {
                    report
                        .errors
                        .push(format!("{at}: expected true or false, found `{other}`"));
                    default
                }
            },
        }
    }

    /// Reads number `name`, whose proto default is also the only value we support, and
    /// reports any other value.
    pub fn only_number<T>(&mut self, name: &str, supported: T, report: &mut Report)
    where
        T: std::str::FromStr + PartialEq + std::fmt::Debug + Copy,
    {
        let v = self.number(name, supported, report);
        require(&self.path, name, v, supported, report);
    }

    /// [`Section::only_number`] for a flag.
    pub fn only_flag(&mut self, name: &str, supported: bool, report: &mut Report) {
        let v = self.flag(name, supported, report);
        require(&self.path, name, v, supported, report);
    }

    /// [`Self::only_flag`] for each `(name, supported)`.
    pub fn only_flags(&mut self, flags: &[(&str, bool)], report: &mut Report) {
        for &(name, supported) in flags {
            self.only_flag(name, supported, report);
        }
    }

    /// The last sub-message called `name`.
    pub fn child(&mut self, name: &str, report: &mut Report) -> Option<Section<'a>> {
        let field = self.take(name).pop()?;
        match &field.value {
            Value::Message(m) => Some(Section::new(m, self.join(name))),
            Value::Scalar(_) => {
                report
                    .errors
                    .push(format!("{}: expected `{{ ... }}`", self.at(field)));
                None
            }
        }
    }

    /// Every sub-message called `name`.
    pub fn children(&mut self, name: &str, report: &mut Report) -> Vec<Section<'a>> {
        let path = self.join(name);
        let fields = self.take(name);
        let mut out = Vec::new();
        for f in fields {
            match &f.value {
                Value::Message(m) => out.push(Section::new(m, path.clone())),
                Value::Scalar(_) => report
                    .errors
                    .push(format!("{}: expected `{{ ... }}`", self.at(f))),
            }
        }
        out
    }

    /// The one set member of a `oneof` among `supported`; any other field is reported by
    /// `finish` as unsupported.
    pub fn one_of(
        &mut self,
        supported: &[&str],
        report: &mut Report,
    ) -> Option<(String, Section<'a>)> {
        let present: Vec<&str> = supported
            .iter()
            .copied()
            .filter(|n| self.message.fields.iter().any(|f| f.name == *n))
            .collect();
        match present[..] {
            [one] => self.child(one, report).map(|s| (one.to_string(), s)),
            [] if self.message.fields.is_empty() => {
                report.errors.push(format!(
                    "{}: one of {} is needed",
                    self.path,
                    supported.join(", ")
                ));
                None
            }
            [] => None,
            _ => {
                report.errors.push(format!(
                    "{}: only one of {} may be set",
                    self.path,
                    present.join(", ")
                ));
                None
            }
        }
    }

    /// Reads the sub-message `name` holding a `oneof` among `supported`: `read` gets the
    /// member's name and section, then the fields of both left unread are reported. Returns
    /// what `read` returned, `None` when the sub-message or its member is absent.
    pub fn read_one_of<T>(
        &mut self,
        name: &str,
        supported: &[&str],
        report: &mut Report,
        read: impl FnOnce(&str, &mut Section<'a>, &mut Report) -> T,
    ) -> Option<T> {
        let mut outer = self.child(name, report)?;
        let out = outer.one_of(supported, report).map(|(kind, mut member)| {
            let out = read(&kind, &mut member, report);
            member.finish(report);
            out
        });
        outer.finish(report);
        out
    }

    /// Marks `names` as read and notes each one present as ignored, with `why`.
    pub fn ignore(&mut self, names: &[&str], why: &str, report: &mut Report) {
        for name in names {
            if let Some(f) = self.take(name).pop() {
                report
                    .notes
                    .push(format!("{}: ignored ({why})", self.at(f)));
            }
        }
    }

    /// Reports every field not read: as a misspelling where its name is one or two edits
    /// from a field this message is read for (`num_clases`), else as unsupported.
    pub fn finish(self, report: &mut Report) {
        for (f, used) in self.message.fields.iter().zip(&self.used) {
            if *used {
                continue;
            }
            let meant = self
                .asked
                .iter()
                .map(|a| (strsim::levenshtein(a, &f.name), a))
                .filter(|(d, _)| *d <= 2)
                .min();
            report.errors.push(match meant {
                Some((_, name)) => format!(
                    "{}: unknown field `{}`, did you mean `{name}`?",
                    self.at(f),
                    f.name
                ),
                None => format!("{}: not supported", self.at(f)),
            });
        }
    }
}

/// `require(value == expected)` with the field named.
pub(super) fn require<T: PartialEq + std::fmt::Debug>(
    path: &str,
    what: &str,
    value: T,
    supported: T,
    report: &mut Report,
) {
    if value != supported {
        report.errors.push(format!(
            "{path}.{what}: {value:?} is not supported (only {supported:?})"
        ));
    }
}
