//! The API's gRPC codec: prost's, except that a message that does not
//! decode (random bytes, a truncated message, a string that is not UTF-8)
//! is the sender's mistake, `INVALID_ARGUMENT` with the decoder's words,
//! not `INTERNAL` (which says the server failed).

use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::{Code, Status};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// prost encoding and decoding, with decode errors as `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct KeelCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for KeelCodec<T, U> {
    fn default() -> Self {
        KeelCodec(ProstCodec::default())
    }
}

impl<T, U> Codec for KeelCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = KeelDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        KeelDecoder(self.0.decoder())
    }
}

/// [`ProstDecoder`] with its errors as `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct KeelDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for KeelDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|status| match status.code() {
            Code::Internal => Status::invalid_argument(format!(
                "the message is not a valid {}: {}",
                std::any::type_name::<U>()
                    .rsplit("::")
                    .next()
                    .unwrap_or("message"),
                status.message()
            )),
            _ => status,
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
