//! COCO `categories` as label-map classes. COCO's own ids (1..=90 with gaps) stay the
//! label-map ids, as in the API's `mscoco_label_map.pbtxt`, so a model trained here has the
//! class numbers of every COCO-trained SSD. Ids that start at 0 (Roboflow and other exports)
//! cannot be label-map ids, 0 being the background: those, or all ids when asked, become
//! 1..=K in the order of the `categories` list.

use std::collections::HashMap;

use serde_json::Value;

use crate::label_map::{LabelMap, LabelMapItem};

/// One category and the label it is written with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Category {
    /// The `id` in the COCO file.
    pub coco_id: i64,
    /// `image/object/class/label` and the label-map id.
    pub label: i64,
    /// `name`: `image/object/class/text` and the label-map name.
    pub name: String,
}

/// The categories of a COCO file, in the file's order.
#[derive(Debug, Clone)]
pub struct Categories {
    /// The categories in the order of the file.
    pub items: Vec<Category>,
    /// Whether ids were mapped to 1..=K.
    pub contiguous: bool,
    by_id: HashMap<i64, usize>,
}

/// `categories[i]`'s id and name: an integer of at least 0 and a name that is not empty.
fn entry(c: &Value, i: usize) -> Result<(i64, String), String> {
    let id = &c["id"];
    let id = id
        .as_i64()
        .filter(|&id| id >= 0)
        .ok_or_else(|| format!("categories[{i}]: `id` {id} is not an integer of at least 0"))?;
    match &c["name"] {
        Value::String(s) if !s.trim().is_empty() => Ok((id, s.clone())),
        name => Err(format!(
            "categories[{i}] (id {id}): `name` {name} is not a class name"
        )),
    }
}

impl Categories {
    /// Reads the `categories` entries. Ids are kept as labels unless one is 0 or `contiguous`
    /// is asked; an id or a name twice is an error naming both entries (a name twice would
    /// make two classes that the label map cannot tell apart).
    pub fn parse(entries: &[Value], contiguous: bool) -> Result<Self, String> {
        if entries.is_empty() {
            return Err("`categories` is empty: there is no class to train".into());
        }
        let mut read = Vec::with_capacity(entries.len());
        let (mut by_id, mut by_name) = (HashMap::new(), HashMap::new());
        for (i, c) in entries.iter().enumerate() {
            let (id, name) = entry(c, i)?;
            if let Some(j) = by_id.insert(id, i) {
                return Err(format!(
                    "categories[{i}]: id {id} appears twice (also categories[{j}])"
                ));
            }
            if let Some(j) = by_name.insert(name.clone(), i) {
                return Err(format!(
                    "categories[{i}] (id {id}): name {name:?} appears twice (also \
                     categories[{j}]): the label map could not tell the two classes apart"
                ));
            }
            read.push((id, name));
        }
        let contiguous = contiguous || read.iter().any(|(id, _)| *id == 0);
        let items = read
            .into_iter()
            .enumerate()
            .map(|(i, (coco_id, name))| Category {
                coco_id,
                label: if contiguous { i as i64 + 1 } else { coco_id },
                name,
            })
            .collect();
        Ok(Self {
            items,
            contiguous,
            by_id,
        })
    }

    /// The category of a COCO id.
    pub fn get(&self, coco_id: i64) -> Option<&Category> {
        self.by_id.get(&coco_id).map(|&i| &self.items[i])
    }

    /// The largest label: the smallest `num_classes` a model trained on these needs.
    pub fn num_classes(&self) -> i64 {
        self.items.iter().map(|c| c.label).max().unwrap_or(0)
    }

    /// The label map: every category under its label.
    pub fn label_map(&self) -> LabelMap {
        let mut items: Vec<LabelMapItem> = self
            .items
            .iter()
            .map(|c| LabelMapItem {
                id: c.label,
                name: c.name.clone(),
                display_name: None,
            })
            .collect();
        items.sort_by_key(|it| it.id);
        LabelMap { items }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value, contiguous: bool) -> Result<Categories, String> {
        Categories::parse(v.as_array().unwrap(), contiguous)
    }

    #[test]
    fn coco_ids_are_kept_and_zero_based_ids_mapped_in_file_order() {
        let sparse = json!([{"id": 90, "name": "toothbrush"}, {"id": 1, "name": "person"},
                            {"id": 18, "name": "dog", "supercategory": "animal"}]);
        let c = parse(sparse.clone(), false).unwrap();
        assert!(!c.contiguous);
        assert_eq!(c.get(18).map(|c| c.label), Some(18));
        assert_eq!(c.num_classes(), 90);
        assert_eq!(
            c.label_map().to_pbtxt(),
            "item {\n  id: 1\n  name: 'person'\n}\n\nitem {\n  id: 18\n  name: 'dog'\n}\n\n\
             item {\n  id: 90\n  name: 'toothbrush'\n}\n\n"
        );
        let c = parse(sparse, true).unwrap();
        let labels: Vec<(i64, i64)> = c.items.iter().map(|c| (c.coco_id, c.label)).collect();
        assert_eq!(labels, [(90, 1), (1, 2), (18, 3)]);
        assert_eq!(c.num_classes(), 3);
        let zero_based = json!([{"id": 0, "name": "cells"}, {"id": 1, "name": "red"}]);
        let c = parse(zero_based, false).unwrap();
        assert!(c.contiguous);
        assert_eq!(c.get(0).map(|c| c.label), Some(1));
        assert_eq!(
            c.get(1).map(|c| (c.label, c.name.as_str())),
            Some((2, "red"))
        );
        assert_eq!(c.get(2), None);
    }

    #[test]
    fn bad_categories_are_named() {
        for (v, want) in [
            (json!([]), "`categories` is empty"),
            (
                json!([{"id": 1, "name": "a"}, {"id": -2, "name": "b"}]),
                "categories[1]: `id` -2 is not an integer of at least 0",
            ),
            (
                json!([{"id": 1.5, "name": "a"}]),
                "categories[0]: `id` 1.5 is not an integer",
            ),
            (
                json!([{"id": 3, "name": ""}]),
                "categories[0] (id 3): `name` \"\" is not a class name",
            ),
            (json!([{"id": 3}]), "categories[0] (id 3): `name` null"),
            (
                json!([{"id": 3, "name": "a"}, {"id": 3, "name": "b"}]),
                "categories[1]: id 3 appears twice (also categories[0])",
            ),
            (
                json!([{"id": 3, "name": "a"}, {"id": 4, "name": "a"}]),
                "categories[1] (id 4): name \"a\" appears twice (also categories[0])",
            ),
        ] {
            let err = parse(v.clone(), false).unwrap_err();
            assert!(err.contains(want), "{v}\n{err}");
        }
    }
}
