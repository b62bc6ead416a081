//! Decoding encoded images as strictly as TensorFlow's decoders: the `image` crate fills the
//! missing part of a truncated JPEG with grey and reports success, while `tf.io.decode_jpeg`
//! (with its default `try_recover_truncated = false`) rejects such a file. So a JPEG must run
//! through its scans to the end-of-image marker, and a PNG to its `IEND` chunk, before its
//! pixels are accepted.

use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader};

/// Decodes `bytes` (JPEG, PNG, GIF, BMP) completely. The error says what is wrong.
pub fn decode_image(bytes: &[u8]) -> Result<(DynamicImage, ImageFormat), String> {
    let format = image::guess_format(bytes).map_err(|e| e.to_string())?;
    match format {
        ImageFormat::Jpeg => check_jpeg_complete(bytes)?,
        ImageFormat::Png => check_png_complete(bytes)?,
        _ => {}
    }
    let image = ImageReader::with_format(Cursor::new(bytes), format)
        .decode()
        .map_err(|e| e.to_string())?;
    if image.width() == 0 || image.height() == 0 {
        return Err("zero-size image".into());
    }
    Ok((image, format))
}

/// Walks the JPEG's marker segments and entropy-coded data up to the end-of-image marker
/// (`FF D9`). Bytes between segments and after the end are tolerated, as libjpeg does.
fn check_jpeg_complete(bytes: &[u8]) -> Result<(), String> {
    let truncated = || {
        Err(format!(
            "truncated JPEG: the data ends after {} bytes, before the end-of-image marker",
            bytes.len()
        ))
    };
    let mut i = 2; // after the start-of-image marker that `guess_format` saw
    loop {
        // the next marker: 0xFF (any fill bytes) then a code that is not a stuffed 0x00
        let Some(ff) = bytes[i..].iter().position(|&b| b == 0xff).map(|p| i + p) else {
            return truncated();
        };
        let Some(code_at) = bytes[ff..].iter().position(|&b| b != 0xff).map(|p| ff + p) else {
            return truncated();
        };
        match bytes[code_at] {
            0xd9 => return Ok(()),
            // stuffed byte, restart markers, TEM: no length field
            0x00 | 0x01 | 0xd0..=0xd7 => i = code_at + 1,
            _ => {
                let Some(len) = bytes.get(code_at + 1..code_at + 3) else {
                    return truncated();
                };
                let len = usize::from(u16::from_be_bytes([len[0], len[1]]));
                if len < 2 || code_at + 1 + len > bytes.len() {
                    return truncated();
                }
                // after a start-of-scan header the entropy-coded data follows; the scan for
                // the next marker above walks through it
                i = code_at + 1 + len;
            }
        }
    }
}

/// Walks the PNG's chunks up to `IEND`.
fn check_png_complete(bytes: &[u8]) -> Result<(), String> {
    let mut i = 8; // after the signature
    while let Some(header) = bytes.get(i..i + 8) {
        let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
        let end = i.saturating_add(12).saturating_add(len);
        if end > bytes.len() {
            break;
        }
        if &header[4..8] == b"IEND" {
            return Ok(());
        }
        i = end;
    }
    Err(format!(
        "truncated PNG: the data ends after {} bytes, before the end of the IEND chunk",
        bytes.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{Rgb, RgbImage};

    fn encoded(format: ImageFormat) -> Vec<u8> {
        // large enough that half the file lies in the scan data, past the headers
        let img = DynamicImage::ImageRgb8(RgbImage::from_fn(160, 120, |x, y| {
            Rgb([(x * 4) as u8, (y * 5) as u8, ((x ^ y) * 3) as u8])
        }));
        let mut out = Vec::new();
        img.write_to(&mut Cursor::new(&mut out), format).unwrap();
        out
    }

    #[test]
    fn complete_images_decode() {
        for format in [ImageFormat::Jpeg, ImageFormat::Png, ImageFormat::Gif] {
            let (img, got) = decode_image(&encoded(format)).unwrap();
            assert_eq!((img.width(), img.height(), got), (160, 120, format));
        }
        // bytes after the end-of-image marker are accepted, as libjpeg accepts them
        let mut jpeg = encoded(ImageFormat::Jpeg);
        jpeg.extend(b"trailing");
        assert!(decode_image(&jpeg).is_ok());
    }

    #[test]
    fn images_cut_short_are_rejected() {
        let jpeg = encoded(ImageFormat::Jpeg);
        let half = &jpeg[..jpeg.len() / 2];
        // the plain decoder accepts the half file: this is what the check is for
        assert!(image::load_from_memory(half).is_ok());
        let err = decode_image(half).unwrap_err();
        let want = format!(
            "truncated JPEG: the data ends after {} bytes, before the end-of-image marker",
            half.len()
        );
        assert_eq!(err, want);
        // only the end-of-image marker missing
        let err = decode_image(&jpeg[..jpeg.len() - 2]).unwrap_err();
        assert!(err.starts_with("truncated JPEG"), "{err}");
        let png = encoded(ImageFormat::Png);
        let err = decode_image(&png[..png.len() / 2]).unwrap_err();
        assert!(err.starts_with("truncated PNG"), "{err}");
        // only IEND missing
        let err = decode_image(&png[..png.len() - 12]).unwrap_err();
        assert!(err.starts_with("truncated PNG"), "{err}");
        assert!(decode_image(b"not an image").is_err());
    }
}
