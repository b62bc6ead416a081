//! The sorted string table of a bundle's `.index` file: TensorFlow's copy of LevelDB's table
//! format (data blocks of prefix-compressed keys with restart points, an index block of block
//! handles, a 48-byte footer ending in the table magic number). Every block's masked CRC32C
//! is checked. Written here because the Rust LevelDB crates read tables only as part of a
//! whole database.

use super::masked_crc32c;

/// `kTableMagicNumber`, the last 8 bytes of every table.
const MAGIC: u64 = 0xdb47_7524_8b80_fb57;
/// Two block handles (up to 20 bytes each, zero padded) and the magic number.
const FOOTER_LEN: usize = 48;
/// A block is followed by its compression type (1 byte) and CRC (4 bytes).
const TRAILER_LEN: usize = 5;

/// Reads a LEB128 varint of at most 64 bits from the front of `input`.
fn varint(input: &mut &[u8]) -> Result<u64, String> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = input
            .split_first()
            .ok_or_else(|| "a varint runs past the end of its block".to_string())?;
        *input = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err("a varint is longer than 10 bytes".into())
}

fn take<'a>(input: &mut &'a [u8], len: usize) -> Result<&'a [u8], String> {
    if input.len() < len {
        return Err(format!(
            "{len} bytes expected, {} left in the block",
            input.len()
        ));
    }
    let (head, rest) = input.split_at(len);
    *input = rest;
    Ok(head)
}

/// `(offset, size)` of a block.
fn block_handle(input: &mut &[u8]) -> Result<(usize, usize), String> {
    let offset = varint(input)?;
    let size = varint(input)?;
    let to_usize = |v: u64| usize::try_from(v).map_err(|_| format!("block handle {v} too large"));
    Ok((to_usize(offset)?, to_usize(size)?))
}

/// The contents of the block at `(offset, size)`, checksum verified.
fn block(file: &[u8], (offset, size): (usize, usize)) -> Result<&[u8], String> {
    let end = offset
        .checked_add(size)
        .and_then(|e| e.checked_add(TRAILER_LEN))
        .filter(|&e| e <= file.len())
        .ok_or_else(|| {
            format!(
                "a block at bytes {offset}..{} lies past the end of the file ({} bytes): truncated?",
                offset.saturating_add(size).saturating_add(TRAILER_LEN),
                file.len()
            )
        })?;
    let with_type = &file[offset..offset + size + 1];
    let stored = u32::from_le_bytes(file[end - 4..end].try_into().expect("4 bytes"));
    if masked_crc32c(with_type) != stored {
        return Err(format!("the block at byte {offset} fails its CRC32C check"));
    }
    match with_type[size] {
        0 => Ok(&file[offset..offset + size]),
        1 => Err(
            "the table is Snappy-compressed, which TensorFlow's checkpoint writer never does"
                .into(),
        ),
        t => Err(format!("unknown block compression type {t}")),
    }
}

/// A key and its value.
type Entry<'a> = (Vec<u8>, &'a [u8]);

/// Every `(key, value)` of one block, in order.
fn entries(block: &[u8]) -> Result<Vec<Entry<'_>>, String> {
    if block.len() < 4 {
        return Err("a block is shorter than its restart count".into());
    }
    let num_restarts = u32::from_le_bytes(block[block.len() - 4..].try_into().expect("4 bytes"));
    let restarts_len = (num_restarts as usize)
        .checked_mul(4)
        .and_then(|n| n.checked_add(4))
        .filter(|&n| n <= block.len())
        .ok_or_else(|| format!("a block claims {num_restarts} restart points"))?;
    let mut input = &block[..block.len() - restarts_len];
    let mut key: Vec<u8> = Vec::new();
    let mut out = Vec::new();
    while !input.is_empty() {
        let shared = varint(&mut input)? as usize;
        let unshared = varint(&mut input)? as usize;
        let value_len = varint(&mut input)? as usize;
        if shared > key.len() {
            return Err(format!(
                "a key shares {shared} bytes with a {}-byte key",
                key.len()
            ));
        }
        key.truncate(shared);
        key.extend_from_slice(take(&mut input, unshared)?);
        out.push((key.clone(), take(&mut input, value_len)?));
    }
    Ok(out)
}

/// An owned key and value.
pub type Row = (Vec<u8>, Vec<u8>);

/// Every `(key, value)` of the table in `file`, in key order.
pub fn read_table(file: &[u8]) -> Result<Vec<Row>, String> {
    if file.len() < FOOTER_LEN {
        return Err(format!(
            "{} bytes is too short for a checkpoint index (at least {FOOTER_LEN})",
            file.len()
        ));
    }
    let footer = &file[file.len() - FOOTER_LEN..];
    let magic = u64::from_le_bytes(footer[40..].try_into().expect("8 bytes"));
    if magic != MAGIC {
        return Err("not a TensorFlow checkpoint index (no table magic number at its end)".into());
    }
    let mut handles = &footer[..40];
    let _metaindex = block_handle(&mut handles)?;
    let index = block(file, block_handle(&mut handles)?)?;
    let mut out = Vec::new();
    for (_, mut handle) in entries(index)? {
        let data = block(file, block_handle(&mut handle)?)?;
        for (key, value) in entries(data)? {
            out.push((key, value.to_vec()));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_decode_and_overruns_are_errors() {
        let mut input: &[u8] = &[0xac, 0x02, 0x05];
        assert_eq!(varint(&mut input), Ok(300));
        assert_eq!(varint(&mut input), Ok(5));
        assert!(varint(&mut input).is_err());
        let mut unterminated: &[u8] = &[0x80, 0x80];
        assert!(varint(&mut unterminated).is_err());
    }

    #[test]
    fn prefix_compressed_keys_are_rebuilt() {
        // "abc" -> "1", then "abd" sharing 2 bytes -> "22"; one restart point at 0
        let mut block = vec![0, 3, 1, b'a', b'b', b'c', b'1', 2, 1, 2, b'd', b'2', b'2'];
        block.extend_from_slice(&0u32.to_le_bytes());
        block.extend_from_slice(&1u32.to_le_bytes());
        let got = entries(&block).unwrap();
        assert_eq!(got[0], (b"abc".to_vec(), &b"1"[..]));
        assert_eq!(got[1], (b"abd".to_vec(), &b"22"[..]));
        let mut bad = block.clone();
        bad[7] = 9; // shares 9 bytes with a 3-byte key
        assert!(entries(&bad).unwrap_err().contains("shares 9 bytes"));
    }

    #[test]
    fn short_or_foreign_files_are_refused() {
        assert!(read_table(&[0; 10]).unwrap_err().contains("too short"));
        assert!(read_table(&[0; 60]).unwrap_err().contains("magic"));
    }
}
