//! Decoding encoded images as strictly as TensorFlow's decoders: the `image` crate fills the
//! missing part of a truncated JPEG with grey and reports success, while `tf.io.decode_jpeg`
//! (with its default `try_recover_truncated = false`) rejects such a file. So a JPEG must run
//! through its scans to the end-of-image marker, and a PNG to its `IEND` chunk, before its
//! pixels are accepted.

use std::io::Cursor;

use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};

/// The widest or tallest image decoded, in pixels. Datasets' photos are far smaller (Oxford-IIIT
/// Pet's widest is about 2,600 pixels); a header of a few bytes can claim billions of pixels,
/// which the decoder would try to allocate.
pub const MAX_IMAGE_SIDE: u32 = 16_384;
/// The most pixels an image decoded may have (100 megapixels, 300 MB as RGB).
pub const MAX_IMAGE_PIXELS: u64 = 100_000_000;

/// Decodes `bytes` (JPEG, PNG, GIF, BMP) completely, after checking the size its header
/// claims against [`MAX_IMAGE_SIDE`] and [`MAX_IMAGE_PIXELS`]. The error says what is wrong.
pub fn decode_image(bytes: &[u8]) -> Result<(DynamicImage, ImageFormat), String> {
    let format = image::guess_format(bytes).map_err(|e| e.to_string())?;
    match format {
        ImageFormat::Jpeg => check_jpeg_complete(bytes)?,
        ImageFormat::Png => check_png_complete(bytes)?,
        _ => {}
    }
    // one reading of the header: its size is checked before any pixel is allocated
    let mut decoder = ImageReader::with_format(Cursor::new(bytes), format)
        .into_decoder()
        .map_err(|e| e.to_string())?;
    let (width, height) = decoder.dimensions();
    check_size(width, height)?;
    // the decoder's own guard, for what the first header does not tell (a GIF's frames)
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    // the largest image allowed, at the widest pixels the decoders make (RGBA, 16 bits)
    limits.max_alloc = Some(8 * MAX_IMAGE_PIXELS);
    decoder.set_limits(limits).map_err(|e| e.to_string())?;
    let image = DynamicImage::from_decoder(decoder).map_err(|e| e.to_string())?;
    Ok((image, format))
}

/// Refuses an empty image or one over the size limits, before its pixels are allocated.
fn check_size(width: u32, height: u32) -> Result<(), String> {
    if width == 0 || height == 0 {
        return Err(format!("zero-size image ({width}x{height})"));
    }
    if width.max(height) > MAX_IMAGE_SIDE || u64::from(width) * u64::from(height) > MAX_IMAGE_PIXELS
    {
        return Err(format!(
            "the header claims {width}x{height} pixels, over the limit of {MAX_IMAGE_SIDE} a side and {} megapixels (a damaged or hostile file?)",
            MAX_IMAGE_PIXELS / 1_000_000
        ));
    }
    Ok(())
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

    /// CRC-32 (ISO-HDLC) as PNG chunks carry it.
    fn png_crc(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in data {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    0xedb8_8320 ^ (crc >> 1)
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    /// `format`'s encoding of the test image, its header claiming `width` x `height`.
    fn claiming(format: ImageFormat, width: u16, height: u16) -> Vec<u8> {
        let mut bytes = encoded(format);
        let (w, h) = (width.to_be_bytes(), height.to_be_bytes());
        match format {
            // IHDR: width and height as u32 after the chunk's length and type, then its CRC
            ImageFormat::Png => {
                bytes[16..24].copy_from_slice(&[0, 0, w[0], w[1], 0, 0, h[0], h[1]]);
                let crc = png_crc(&bytes[12..29]);
                bytes[29..33].copy_from_slice(&crc.to_be_bytes());
            }
            // the start-of-frame segment: FF C0, length, precision, then height and width
            ImageFormat::Jpeg => {
                let sof = bytes.windows(2).position(|m| m == [0xff, 0xc0]).unwrap();
                bytes[sof + 5..sof + 9].copy_from_slice(&[h[0], h[1], w[0], w[1]]);
            }
            // the logical screen: width and height, little-endian, after "GIF89a"
            _ => {
                let (w, h) = (width.to_le_bytes(), height.to_le_bytes());
                bytes[6..10].copy_from_slice(&[w[0], w[1], h[0], h[1]]);
            }
        }
        bytes
    }

    #[test]
    fn headers_claiming_huge_images_are_refused_before_decoding() {
        for format in [ImageFormat::Png, ImageFormat::Jpeg, ImageFormat::Gif] {
            let err = decode_image(&claiming(format, 30_000, 30_000)).unwrap_err();
            assert!(
                err.contains("claims 30000x30000 pixels, over the limit"),
                "{format:?}: {err}"
            );
            // a side within the limit but too many pixels
            let err = decode_image(&claiming(format, 16_000, 16_000)).unwrap_err();
            assert!(err.contains("claims 16000x16000"), "{format:?}: {err}");
            // the patch itself leaves a file that decodes, as a check of the test
            assert!(
                decode_image(&claiming(format, 160, 120)).is_ok(),
                "{format:?}"
            );
        }
        // no pixels at all: the PNG decoder refuses the header itself, the GIF one leaves it
        // to the size check
        assert!(decode_image(&claiming(ImageFormat::Png, 0, 120)).is_err());
        let err = decode_image(&claiming(ImageFormat::Gif, 0, 120)).unwrap_err();
        assert!(err.contains("zero-size image (0x120)"), "{err}");
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
