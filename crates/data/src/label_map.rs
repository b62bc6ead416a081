//! Label maps in the Object Detection API's protobuf text format:
//! `item { id: 1 name: 'cat' display_name: "Cat" }`, with `#` comments.

use std::path::Path;

use crate::error::{DataError, Result};
use crate::textproto::{Message, Scalar, Value};

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

impl LabelMap {
    /// Parses label-map text. Fields other than `id`, `name` and `display_name` are skipped.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let document = Message::parse(text)?;
        let mut items = Vec::new();
        for field in &document.fields {
            let line = field.line;
            let item = match (&field.name[..], &field.value) {
                ("item", Value::Message(m)) => m,
                (name, _) => return Err(format!("line {line}: expected `item`, found `{name}`")),
            };
            let (mut id, mut name, mut display_name) = (None, None, None);
            for f in &item.fields {
                let line = f.line;
                match (&f.name[..], &f.value) {
                    ("id", Value::Scalar(Scalar::Number(n))) => {
                        id = Some(
                            n.parse::<i64>()
                                .map_err(|_| format!("line {line}: bad id {n:?}"))?,
                        );
                    }
                    ("name", Value::Scalar(Scalar::Str(s))) => name = Some(s.clone()),
                    ("display_name", Value::Scalar(Scalar::Str(s))) => {
                        display_name = Some(s.clone())
                    }
                    ("id" | "name" | "display_name", _) => {
                        return Err(format!("line {line}: bad value for `{}`", f.name));
                    }
                    _ => {}
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
        if items.is_empty() {
            return Err("no `item`: a label map names at least one class".into());
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

    /// Class names in id order.
    pub fn names(&self) -> Vec<String> {
        self.items.iter().map(|it| it.name.clone()).collect()
    }

    /// The name of each of `num_classes` classes by position (for `SsdConfig::class_names`):
    /// id `i` is class `i`, as the Object Detection API reads labels, so an id without an
    /// item (COCO's map has 80 ids in 1..=90) keeps its place, named `class_<id>`; returned
    /// with those ids. An id over `num_classes` is an error.
    pub fn names_by_id(
        &self,
        num_classes: usize,
    ) -> std::result::Result<(Vec<String>, Vec<i64>), String> {
        if let Some(it) = self.items.iter().find(|it| it.id > num_classes as i64) {
            return Err(format!(
                "id {} ({:?}) is over num_classes {num_classes}",
                it.id, it.name
            ));
        }
        let mut names: Vec<String> = (1..=num_classes).map(|id| format!("class_{id}")).collect();
        let mut missing: Vec<i64> = (1..=num_classes as i64).collect();
        for it in &self.items {
            names[it.id as usize - 1] = it.name.clone();
            missing.retain(|&id| id != it.id);
        }
        Ok((names, missing))
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
    fn names_keep_each_id_in_its_place() {
        let map = LabelMap::parse("item { id: 7 name: 'dog' } item { id: 2 name: 'cat' }").unwrap();
        let (names, missing) = map.names_by_id(8).unwrap();
        assert_eq!(names[1], "cat");
        assert_eq!(names[6], "dog");
        assert_eq!(names[0], "class_1");
        assert_eq!(missing, vec![1, 3, 4, 5, 6, 8]);
        let err = map.names_by_id(6).unwrap_err();
        assert!(
            err.contains("id 7 (\"dog\") is over num_classes 6"),
            "{err}"
        );
    }

    #[test]
    fn errors_name_the_line() {
        for (text, want) in [
            ("item { id: 1 name: 'a }", "line 1"),
            ("item { name: 'a' }", "without `id`"),
            ("item {\n id: 0 name: 'a' }", "at least 1"),
            ("thing { }", "expected `item`"),
            ("item { id: 1 name: 'a' } item { id: 1 name: 'b' }", "twice"),
            ("# no items\n", "no `item`"),
        ] {
            let err = LabelMap::parse(text).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
    }
}
