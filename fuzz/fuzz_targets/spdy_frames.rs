//! SPDY/3.1 framing and header blocks (minicri_codecs::spdy, codecs/src/spdy): any bytes a
//! streaming client sends, cut into frames as the connection's reader cuts them and decoded with
//! one header decompressor (one zlib stream per direction), never panic and never inflate a header
//! block past its cap; every frame that decodes encodes again and decodes back to itself; any
//! bytes as an uncompressed header block never panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minicri_codecs::spdy::headers::{HeaderCompressor, HeaderDecompressor, Headers};
use minicri_codecs::spdy::{self, Frame};

fuzz_target!(|data: &[u8]| {
    let _ = Headers::decode(data);

    let mut z = HeaderDecompressor::new();
    let mut again_c = HeaderCompressor::new();
    let mut again_d = HeaderDecompressor::new();
    let mut rest = data;
    while rest.len() >= 8 {
        let header: [u8; 8] = rest[..8].try_into().expect("8 bytes");
        let len = spdy::payload_len(&header);
        if len > spdy::MAX_RECV_PAYLOAD || rest.len() < 8 + len {
            // The reader refuses the frame (or waits for the rest of it).
            return;
        }
        let payload = rest[8..8 + len].to_vec();
        rest = &rest[8 + len..];
        let frame = match spdy::decode(&header, payload, &mut z) {
            Ok(f) => f,
            // A decode error ends the connection: the zlib stream cannot be trusted after it.
            Err(_) => return,
        };
        if let Frame::SynStream { headers, .. }
        | Frame::SynReply { headers, .. }
        | Frame::Headers { headers, .. } = &frame
        {
            let size: usize = headers.0.iter().map(|(n, v)| n.len() + v.len() + 8).sum();
            assert!(
                size <= spdy::headers::MAX_BLOCK,
                "a header block of {size} bytes got through"
            );
        }
        if matches!(frame, Frame::Unknown { .. }) {
            continue;
        }
        let mut wire = Vec::new();
        spdy::encode(&frame, &mut again_c, &mut wire).expect("a decoded frame encodes");
        let h: [u8; 8] = wire[..8].try_into().expect("8 bytes");
        assert_eq!(spdy::payload_len(&h), wire.len() - 8);
        let back = spdy::decode(&h, wire[8..].to_vec(), &mut again_d).expect("decodes back");
        assert_eq!(back, frame);
    }
});
